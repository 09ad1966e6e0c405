// The request path's decode and validation under generated input.
//
// A ModelInfer request reaches the core through CheckModel (model_info.h) and
// MakeInferRequest (request_convert.h: DescribeRequest, ValidateRequest,
// ParseSessionParameters, the timeout), in the order InferHandler::Submit
// calls them. This file holds three pieces that test that path:
//   - GenerateCase: a structure-aware generator. It builds a valid request
//     (FP32/BF16/FP16, random B and T, with or without sequence and timeout
//     parameters) for a random model, then applies random Mutations (wrong
//     datatypes, ranks 0..10000, negative, huge and wrapping dimensions, byte
//     counts off by one, missing and duplicate inputs and raw contents, huge or
//     invalid-UTF-8 names, parameters of every type, random byte flips of the
//     serialized message re-parsed).
//   - an oracle that reads the request against the protocol's rules
//     (request_convert.h, validation.h, PROTOCOL.md) written out a second
//     time, in 128-bit arithmetic, without calling the code under test;
//   - JudgeOutcome / CheckRequestPath: run the path and compare. The
//     properties: the answer's code is the oracle's; an accepted request's
//     B x T x hidden x element size is its byte count, within the model's
//     limits, viewing the request's own bytes, with the session and deadline
//     the parameters ask for; a refusal's message fits kMaxStatusMessageBytes
//     without the edge's cap (so the cap never cuts a message the code built)
//     and names one of the fields at fault.
// request_fuzz_test.cc drives the generator with a seeded PRNG for a bounded
// number of cases (CI); request_fuzzer.cc drives it with libFuzzer's bytes
// (an optional clang build, -DLAYERSERVE_LIBFUZZER=ON).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpc_service.pb.h"
#include "server/core/clock.h"
#include "server/core/request.h"
#include "server/grpc/served_model.h"

namespace layerserve::fuzz {

// Where the generator's choices come from.
class Entropy {
 public:
  virtual ~Entropy() = default;
  // A value in [0, n); requires n >= 1.
  virtual uint64_t Below(uint64_t n) = 0;

  bool OneIn(uint64_t n) { return Below(n) == 0; }
  // A value in [lo, hi]; requires lo <= hi.
  int64_t InRange(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(Below(static_cast<uint64_t>(hi - lo) + 1));
  }
  template <typename T>
  const T& Pick(std::span<const T> options) {
    return options[Below(options.size())];
  }
};

// Choices from a 64-bit Mersenne Twister: case `index` of run `seed` is the
// same on every machine (the standard fixes mt19937_64's sequence; the
// reduction to [0, n) is done here, not by a library distribution).
class SeededEntropy : public Entropy {
 public:
  SeededEntropy(uint64_t seed, uint64_t index);
  uint64_t Below(uint64_t n) override;

 private:
  std::mt19937_64 engine_;
};

// Choices read from a byte string (libFuzzer's input), as few bytes per
// choice as its range needs; 0 once the bytes run out, so a short input
// makes the first choice everywhere (a small valid request).
class ByteEntropy : public Entropy {
 public:
  explicit ByteEntropy(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  uint64_t Below(uint64_t n) override;

 private:
  std::span<const uint8_t> bytes_;
};

// The classes of bad input the generator tries, for the record of a run.
enum class Mutation {
  kDatatype,          // another datatype string (INT32, "fp32", "", huge, invalid UTF-8, ...)
  kDatatypeSwap,      // another accepted datatype with the bytes left as they were
  kRank,              // rank 0..10, or 10000
  kDimension,         // one dimension 0, negative, huge, hidden +-1, over the token limits
  kNegativePair,      // two dimensions negated: the product keeps its sign and value
  kOverflow,          // B x T x hidden x size past 2^63, some wrapping modulo 2^64 to
                      // exactly the raw bytes' count (through B, T, or B x T)
  kByteCount,         // raw_input_contents[0] a byte or an element too short or long, empty
  kInputs,            // no input, two inputs, another input beside hidden_states
  kRawContents,       // no raw entry, two, an empty extra one
  kTypedContents,     // InferTensorContents set, with and without raw bytes
  kInputName,         // input name wrong, empty, huge, invalid UTF-8, with a NUL
  kModel,             // model name or version unknown, huge, invalid UTF-8
  kOutputs,           // requested outputs unknown, huge, many
  kParameter,         // a request parameter of any name (the reserved ones, unknown, huge)
                      // with a value of any type
  kRequestId,         // huge or invalid-UTF-8 request id (echoed, never refused)
  kTensorParameters,  // parameters on the input tensor (ignored)
  kByteFlip,          // the serialized message with bits flipped, bytes overwritten,
                      // truncated, extended or repeated, then parsed again
  kCount,
};
inline constexpr int kMutationCount = static_cast<int>(Mutation::kCount);
std::string_view MutationName(Mutation mutation);

// One generated request and the model it is sent to.
struct FuzzCase {
  ServedModel model;
  inference::ModelInferRequest request;
  // The call's deadline as the transport would give it (unset: none).
  std::optional<std::chrono::microseconds> transport_timeout;
  std::vector<Mutation> mutations;  // in the order applied; empty: a valid request
  // The byte flips left bytes protobuf refuses to parse: gRPC answers such a
  // message itself (docs/protocol.md: Errors), so there is nothing of ours to check.
  bool unparsable = false;
};

FuzzCase GenerateCase(Entropy& entropy);

// What one check found.
struct CheckOutcome {
  absl::StatusCode code = absl::StatusCode::kOk;  // the path's answer
  std::string violation;                          // empty when every property held
};

// Judges `made`, the path's answer for `c` at `now`, against the oracle.
CheckOutcome JudgeOutcome(const FuzzCase& c,
                          const absl::StatusOr<std::unique_ptr<InferRequest>>& made,
                          SteadyTime now);

// Runs `c` through CheckModel and MakeInferRequest and judges the answer.
// Requires !c.unparsable.
CheckOutcome CheckRequestPath(const FuzzCase& c);

// `request` in protobuf's text form, cut to `max_bytes` (a failing case can
// hold a megabyte-long name), for failure reports.
std::string ShortDescription(const inference::ModelInferRequest& request, size_t max_bytes = 2000);

}  // namespace layerserve::fuzz
