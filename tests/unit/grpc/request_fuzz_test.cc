// The request path's decode and validation under generated input
// (request_fuzz.h): a seeded run of generated cases, bounded so that CI
// spends a few seconds on it, and the judge's own test (it must catch wrong
// answers, or a green run would prove nothing).
//
// Environment, for longer runs and for reproducing a failure:
//   LAYERSERVE_FUZZ_CASES    cases to run (default kDefaultCases)
//   LAYERSERVE_FUZZ_SECONDS  > 0: run for this long instead
//   LAYERSERVE_FUZZ_SEED     the run's seed (default 1); case i of a seed is
//                            the same on every machine
//   LAYERSERVE_FUZZ_CASE     run case i alone and print it (a failure names
//                            its seed and case)
#include "tests/unit/grpc/request_fuzz.h"

#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "server/grpc/status_convert.h"

namespace layerserve::fuzz {
namespace {

// About 2 s at the 60 000 to 110 000 cases/s of a 2-core machine.
constexpr int64_t kDefaultCases = 200000;

// The unsigned value of environment variable `name`, or nullopt when unset.
std::optional<uint64_t> EnvNumber(const char* name) {
  const char* text = std::getenv(name);
  uint64_t value = 0;
  if (text == nullptr) return std::nullopt;
  if (!absl::SimpleAtoi(text, &value)) {
    ADD_FAILURE() << name << "=" << text << " is not a non-negative integer";
    return std::nullopt;
  }
  return value;
}

TEST(RequestFuzzTest, GeneratedRequestsKeepEveryProperty) {
  const uint64_t seed = EnvNumber("LAYERSERVE_FUZZ_SEED").value_or(1);
  const std::optional<uint64_t> only_case = EnvNumber("LAYERSERVE_FUZZ_CASE");
  const std::optional<uint64_t> seconds = EnvNumber("LAYERSERVE_FUZZ_SECONDS");
  const uint64_t cases = EnvNumber("LAYERSERVE_FUZZ_CASES").value_or(kDefaultCases);
  ASSERT_FALSE(HasFailure());

  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  const auto more = [&](uint64_t i) {
    if (only_case) return i == *only_case;
    if (seconds && *seconds > 0) return Clock::now() - start < std::chrono::seconds(*seconds);
    return i < cases;
  };
  std::array<int64_t, kMutationCount> tried{};
  std::map<absl::StatusCode, int64_t> answers;
  int64_t generated = 0, unparsable = 0, checked = 0, failures = 0;
  for (uint64_t i = only_case.value_or(0); more(i); ++i) {
    SeededEntropy entropy(seed, i);
    const FuzzCase c = GenerateCase(entropy);
    ++generated;
    for (const Mutation mutation : c.mutations) ++tried[static_cast<int>(mutation)];
    const auto mutations = [&] {
      return absl::StrJoin(c.mutations, ", ",
                           [](std::string* out, Mutation m) { out->append(MutationName(m)); });
    };
    if (only_case) {
      std::fprintf(stderr, "[fuzz] case %llu: mutations {%s}%s\n  %s\n",
                   static_cast<unsigned long long>(i), mutations().c_str(),
                   c.unparsable ? ", unparsable" : "", ShortDescription(c.request).c_str());
    }
    if (c.unparsable) {
      ++unparsable;
      continue;
    }
    const CheckOutcome outcome = CheckRequestPath(c);
    ++checked;
    ++answers[outcome.code];
    // A handful of reports is enough to start from; a broken rule would
    // otherwise print thousands.
    if (!outcome.violation.empty() && ++failures <= 5) {
      ADD_FAILURE() << "LAYERSERVE_FUZZ_SEED=" << seed << " LAYERSERVE_FUZZ_CASE=" << i
                    << ", mutations {" << mutations() << "}: " << outcome.violation
                    << "\n  request: " << ShortDescription(c.request);
    }
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();

  std::string by_code, by_mutation;
  for (const auto& [code, count] : answers) {
    absl::StrAppend(&by_code, " ", absl::StatusCodeToString(code), "=", count);
  }
  for (int m = 0; m < kMutationCount; ++m) {
    absl::StrAppend(&by_mutation, " ", ToAbsl(MutationName(static_cast<Mutation>(m))), "=",
                    tried[m]);
  }
  std::fprintf(stderr,
               "[fuzz] seed %llu: %lld cases in %.2f s (%.0f cases/s): %lld checked, %lld "
               "unparsable after byte flips, %lld violations\n[fuzz] answers:%s\n[fuzz] "
               "mutations:%s\n",
               static_cast<unsigned long long>(seed), static_cast<long long>(generated), elapsed,
               static_cast<double>(generated) / elapsed, static_cast<long long>(checked),
               static_cast<long long>(unparsable), static_cast<long long>(failures),
               by_code.c_str(), by_mutation.c_str());
  EXPECT_EQ(failures, 0);

  // A run of the default size must have tried every class of bad input and
  // met every answer, or the generator has stopped making them.
  if (only_case || generated < kDefaultCases) return;
  for (int m = 0; m < kMutationCount; ++m) {
    EXPECT_GT(tried[m], 0) << "no case tried " << MutationName(static_cast<Mutation>(m));
  }
  for (const absl::StatusCode code :
       {absl::StatusCode::kOk, absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
        absl::StatusCode::kFailedPrecondition}) {
    EXPECT_GT(answers[code], 0) << "no case was answered " << absl::StatusCodeToString(code);
  }
}

// ---------------------------------------------------------------------------
// The judge catches wrong answers.

// A valid FP32 request of shape [1, 2, 8] for a model with sessions.
FuzzCase ValidCase() {
  FuzzCase c;
  c.model.name = "demo";
  c.model.backend = "cpu";
  c.model.config.hidden_size = 8;
  c.model.max_batch_tokens = 16;
  c.model.sessions = true;
  c.request.set_model_name("demo");
  c.request.set_id("r");
  auto* input = c.request.add_inputs();
  input->set_name("hidden_states");
  input->set_datatype("FP32");
  for (const int64_t dim : {1, 2, 8}) input->add_shape(dim);
  c.request.add_raw_input_contents(std::string(2 * 8 * 4, '\0'));
  return c;
}

const SteadyTime kNow = SteadyTime() + std::chrono::hours(1000);

// The answer a correct path gives for `c`'s request.
std::unique_ptr<InferRequest> Accepted(const FuzzCase& c) {
  auto made = std::make_unique<InferRequest>();
  made->id = c.request.id();
  made->dtype = DType::kF32;
  made->batch = c.request.inputs(0).shape(0);
  made->seq_len = c.request.inputs(0).shape(1);
  made->hidden = c.request.inputs(0).shape(2);
  made->input = c.request.raw_input_contents(0);
  return made;
}

std::string Violation(const FuzzCase& c, absl::StatusOr<std::unique_ptr<InferRequest>> made) {
  return JudgeOutcome(c, made, kNow).violation;
}

TEST(RequestFuzzJudgeTest, PassesTheRightAnswers) {
  const FuzzCase valid = ValidCase();
  EXPECT_EQ(Violation(valid, Accepted(valid)), "");
  EXPECT_EQ(CheckRequestPath(valid).violation, "");

  FuzzCase short_bytes = ValidCase();
  short_bytes.request.mutable_raw_input_contents(0)->pop_back();
  EXPECT_EQ(Violation(short_bytes, absl::InvalidArgumentError(
                                       "input 'hidden_states': raw_input_contents[0] holds 63")),
            "");
}

TEST(RequestFuzzJudgeTest, CatchesWrongAcceptance) {
  FuzzCase short_bytes = ValidCase();
  short_bytes.request.mutable_raw_input_contents(0)->pop_back();
  EXPECT_NE(Violation(short_bytes, Accepted(short_bytes)), "");

  // 2^61 + 2 tokens of 8 FP32 values: 2^66 + 64 bytes, 64 modulo 2^64.
  FuzzCase wrapping = ValidCase();
  wrapping.request.mutable_inputs(0)->set_shape(1, (int64_t{1} << 61) + 2);
  EXPECT_NE(Violation(wrapping, Accepted(wrapping)), "");

  FuzzCase stray_flag = ValidCase();
  (*stray_flag.request.mutable_parameters())["sequence_end"].set_bool_param(true);
  EXPECT_NE(Violation(stray_flag, Accepted(stray_flag)), "");
}

TEST(RequestFuzzJudgeTest, CatchesWrongRequestsBuiltFromValidOnes) {
  const FuzzCase valid = ValidCase();
  std::unique_ptr<InferRequest> wrong = Accepted(valid);
  const std::string copy(valid.request.raw_input_contents(0));
  wrong->input = copy;  // the same bytes, but not a view of the request
  EXPECT_NE(Violation(valid, std::move(wrong)), "");

  wrong = Accepted(valid);
  wrong->seq_len = 1;
  EXPECT_NE(Violation(valid, std::move(wrong)), "");

  wrong = Accepted(valid);
  wrong->deadline = kNow;
  EXPECT_NE(Violation(valid, std::move(wrong)), "");

  FuzzCase session = ValidCase();
  (*session.request.mutable_parameters())["sequence_id"].set_int64_param(7);
  EXPECT_NE(Violation(session, Accepted(session)), "") << "the session was dropped";
}

TEST(RequestFuzzJudgeTest, CatchesWrongRefusals) {
  const FuzzCase valid = ValidCase();
  EXPECT_NE(Violation(valid, absl::InvalidArgumentError("raw_input_contents")), "");

  FuzzCase bad = ValidCase();
  bad.request.mutable_inputs(0)->set_datatype("INT32");
  EXPECT_NE(Violation(bad, absl::InvalidArgumentError("bad request")), "")
      << "a message naming no field";
  EXPECT_NE(Violation(bad, absl::InvalidArgumentError(std::string(kMaxStatusMessageBytes + 1, 'd') +
                                                      "datatype")),
            "")
      << "a message the edge would have to cut";
  EXPECT_NE(Violation(bad, absl::NotFoundError("datatype")), "") << "the wrong code";
}

}  // namespace
}  // namespace layerserve::fuzz
