// Generator, oracle and judge of the request path's fuzz test (see
// request_fuzz.h).
#include "tests/unit/grpc/request_fuzz.h"

#include <google/protobuf/stubs/logging.h>

#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "server/grpc/model_info.h"
#include "server/grpc/request_convert.h"
#include "server/grpc/status_convert.h"

namespace layerserve::fuzz {

SeededEntropy::SeededEntropy(uint64_t seed, uint64_t index) {
  // SplitMix64's finalizer over (seed, index), so that neighbouring cases
  // start from unrelated states (std::seed_seq would do as well, at several
  // times the cost of a small case).
  uint64_t z = seed * 0x9E3779B97F4A7C15u + index;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
  engine_.seed(z ^ (z >> 31));
}

uint64_t SeededEntropy::Below(uint64_t n) {
  // The modulo's bias (at most n / 2^64) does not matter to a fuzzer.
  return engine_() % n;
}

uint64_t ByteEntropy::Below(uint64_t n) {
  uint64_t value = 0;
  // One byte per 8 bits of the range, so that libFuzzer's byte mutations map
  // onto single choices.
  for (uint64_t range = n - 1; range > 0 && !bytes_.empty(); range >>= 8) {
    value = (value << 8) | bytes_.front();
    bytes_ = bytes_.subspan(1);
  }
  return value % n;
}

std::string_view MutationName(Mutation mutation) {
  switch (mutation) {
    case Mutation::kDatatype:
      return "datatype";
    case Mutation::kDatatypeSwap:
      return "datatype swap";
    case Mutation::kRank:
      return "rank";
    case Mutation::kDimension:
      return "dimension";
    case Mutation::kNegativePair:
      return "negative pair";
    case Mutation::kOverflow:
      return "overflow";
    case Mutation::kByteCount:
      return "byte count";
    case Mutation::kInputs:
      return "inputs";
    case Mutation::kRawContents:
      return "raw contents";
    case Mutation::kTypedContents:
      return "typed contents";
    case Mutation::kInputName:
      return "input name";
    case Mutation::kModel:
      return "model";
    case Mutation::kOutputs:
      return "outputs";
    case Mutation::kParameter:
      return "parameter";
    case Mutation::kRequestId:
      return "request id";
    case Mutation::kTensorParameters:
      return "tensor parameters";
    case Mutation::kByteFlip:
      return "byte flip";
    case Mutation::kCount:
      break;
  }
  return "?";
}

namespace {

using inference::InferParameter;
using inference::ModelInferRequest;
using Int128 = __int128;

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();
constexpr uint64_t kUint64Max = std::numeric_limits<uint64_t>::max();
constexpr std::string_view kTensor = "hidden_states";

template <typename T, size_t N>
const T& PickOf(Entropy& e, const std::array<T, N>& options) {
  return e.Pick(std::span<const T>(options));
}

// Bytes per element of a datatype the server accepts; nullopt otherwise.
// Written from PROTOCOL.md's table, not from base/dtype.h.
std::optional<int64_t> ElementBytes(std::string_view datatype) {
  if (datatype == "FP32") return 4;
  if (datatype == "FP16" || datatype == "BF16") return 2;
  return std::nullopt;
}

// Strings clients get wrong: empty, around and far past the 128 bytes an
// error message echoes (base/echo.h), a megabyte, invalid UTF-8 (which gRPC
// refuses on the wire, but the path must survive in process too), a NUL
// inside, random bytes.
std::string OddString(Entropy& e) {
  static constexpr std::array<std::string_view, 5> kInvalidUtf8 = {"\x80", "ab\xE2\x82", "\xC0\x80",
                                                                   "\xFE\xFF", "hidden_states\xFF"};
  switch (e.Below(7)) {
    case 0:
      return "";
    case 1:
      return std::string(static_cast<size_t>(e.InRange(100, 300)), 'n');
    case 2:
      return std::string(static_cast<size_t>(e.InRange(1000, 70000)), 'n');
    case 3:
      return std::string(e.OneIn(8) ? size_t{1} << 20 : size_t{4096}, 'n');
    case 4:
      return std::string(PickOf(e, kInvalidUtf8));
    case 5:
      return std::string("hidden_states\0x", 15);
    default: {
      std::string s(static_cast<size_t>(e.InRange(1, 64)), '\0');
      for (char& ch : s) ch = static_cast<char>(e.Below(256));
      return s;
    }
  }
}

ServedModel RandomModel(Entropy& e) {
  // Small hidden sizes keep a case's bytes (and its time) small; the rules
  // do not depend on the size.
  static constexpr std::array<int64_t, 3> kHidden = {8, 32, 128};
  static constexpr std::array<int64_t, 4> kMaxBatchTokens = {64, 1, 16, 256};
  ServedModel model;
  model.name = "demo";
  model.version = "1";
  model.backend = "cpu";
  model.config.hidden_size = PickOf(e, kHidden);
  model.max_batch_tokens = PickOf(e, kMaxBatchTokens);
  model.sessions = !e.OneIn(3);
  if (!model.sessions && e.OneIn(2)) model.sessions_off_reason = "--kv-cache-memory=0";
  return model;
}

// Valid sequence parameters as tritonclient (and layerserve's client) send
// them: a non-zero int64, uint64 or string id, and maybe the flags and a
// position.
void AddSessionParameters(Entropy& e, ModelInferRequest* request) {
  auto& parameters = *request->mutable_parameters();
  switch (e.Below(3)) {
    case 0:
      parameters["sequence_id"].set_int64_param(e.InRange(1, int64_t{1} << 40) *
                                                (e.OneIn(4) ? -1 : 1));
      break;
    case 1:
      parameters["sequence_id"].set_uint64_param(1 + e.Below(kUint64Max));
      break;
    default:
      parameters["sequence_id"].set_string_param(
          e.OneIn(2) ? absl::StrCat("user-", e.Below(1000))
                     : std::string(static_cast<size_t>(e.InRange(1, kMaxSequenceIdBytes)), 's'));
      break;
  }
  if (e.OneIn(2)) parameters["sequence_start"].set_bool_param(e.OneIn(2));
  if (e.OneIn(2)) parameters["sequence_end"].set_bool_param(e.OneIn(2));
  if (e.OneIn(4)) {
    const int64_t position = e.InRange(0, 4096);
    if (e.OneIn(2)) {
      parameters["sequence_position"].set_int64_param(position);
    } else {
      parameters["sequence_position"].set_uint64_param(static_cast<uint64_t>(position));
    }
  }
}

// A request the rules accept for `model`: hidden_states of a random datatype
// and shape within the limits (token counts spread over every power of two
// up to them), maybe the output named, parameters the server ignores, a
// session and a timeout.
void BuildValidRequest(Entropy& e, const ServedModel& model, ModelInferRequest* request) {
  static constexpr std::array<std::string_view, 3> kDatatypes = {"FP32", "BF16", "FP16"};
  request->set_model_name(model.name);
  if (e.OneIn(2)) request->set_model_version(e.OneIn(2) ? model.version : "");
  if (!e.OneIn(3)) request->set_id(absl::StrCat("request-", e.Below(1000000)));
  auto* input = request->add_inputs();
  input->set_name(std::string(kTensor));
  const std::string_view datatype = PickOf(e, kDatatypes);
  input->set_datatype(std::string(datatype));
  const int64_t batch = e.InRange(1, std::min<int64_t>(4, model.max_batch_tokens));
  const int64_t most_tokens = model.max_batch_tokens / batch;
  const int64_t tokens_cap = std::min<int64_t>(most_tokens, int64_t{1} << e.Below(9));
  const int64_t tokens = e.InRange(1, tokens_cap);
  for (const int64_t dim : {batch, tokens, model.config.hidden_size}) input->add_shape(dim);
  const int64_t bytes = batch * tokens * model.config.hidden_size * *ElementBytes(datatype);
  request->add_raw_input_contents(
      std::string(static_cast<size_t>(bytes), static_cast<char>(e.Below(256))));
  if (e.OneIn(4)) request->add_outputs()->set_name(std::string(kTensor));
  auto& parameters = *request->mutable_parameters();
  if (e.OneIn(4)) parameters["priority"].set_uint64_param(e.Below(10));
  if (e.OneIn(8)) parameters["binary_data_output"].set_bool_param(true);
  if (e.OneIn(2)) AddSessionParameters(e, request);
  if (e.OneIn(4)) {
    static constexpr std::array<int64_t, 6> kTimeoutsUs = {
        0, 1, 1000, 1'000'000, 1'000'000'000'000, kInt64Max};
    parameters["timeout"].set_int64_param(PickOf(e, kTimeoutsUs));
  }
}

// A value of any type the protocol has, and none: the values around each
// rule's edges (0, -1, 2^63, a 256- and a 257-byte string, NaN).
void SetRandomValue(Entropy& e, InferParameter* p) {
  static constexpr std::array<int64_t, 8> kInts = {
      0, 1, -1, kInt64Min, kInt64Max, 42, int64_t{1} << 62, 1'000'000};
  static constexpr std::array<uint64_t, 6> kUints = {
      0, 1, 42, uint64_t{1} << 63, (uint64_t{1} << 63) - 1, kUint64Max};
  static constexpr std::array<double, 5> kDoubles = {0.0, 1.5, -0.0,
                                                     std::numeric_limits<double>::quiet_NaN(),
                                                     std::numeric_limits<double>::infinity()};
  switch (e.Below(6)) {
    case 0:
      p->set_bool_param(e.OneIn(2));
      break;
    case 1:
      p->set_int64_param(PickOf(e, kInts));
      break;
    case 2:
      p->set_uint64_param(PickOf(e, kUints));
      break;
    case 3:
      switch (e.Below(5)) {
        case 0:
          p->set_string_param("7");
          break;
        case 1:
          p->set_string_param(std::string(kMaxSequenceIdBytes, 's'));
          break;
        case 2:
          p->set_string_param(std::string(kMaxSequenceIdBytes + 1, 's'));
          break;
        default:
          p->set_string_param(OddString(e));
          break;
      }
      break;
    case 4:
      p->set_double_param(PickOf(e, kDoubles));
      break;
    default:
      p->Clear();  // the oneof unset: a parameter with no value
      break;
  }
}

// A parameter name: the reserved ones most often, then near misses, names
// nobody reserved, and odd strings.
std::string ParameterName(Entropy& e) {
  static constexpr std::array<std::string_view, 9> kNames = {
      "sequence_id", "sequence_start", "sequence_end", "sequence_position", "timeout",
      "priority",    "SEQUENCE_ID",    "sequence_id ", "binary_data_output"};
  if (e.OneIn(6)) return OddString(e);
  return std::string(PickOf(e, kNames));
}

ModelInferRequest::InferInputTensor* FirstInput(ModelInferRequest* request) {
  return request->inputs_size() > 0 ? request->mutable_inputs(0) : nullptr;
}

// Applies `mutation` to `c`; false when it does not apply (no input left to
// change), so the run's record counts only mutations made.
bool Mutate(Mutation mutation, Entropy& e, FuzzCase& c) {
  ModelInferRequest& request = c.request;
  ModelInferRequest::InferInputTensor* input = FirstInput(&request);
  const int64_t hidden = c.model.config.hidden_size;
  const int64_t element_bytes = input ? ElementBytes(input->datatype()).value_or(4) : 4;
  switch (mutation) {
    case Mutation::kDatatype: {
      if (!input) return false;
      static constexpr std::array<std::string_view, 12> kDatatypes = {
          "INT32", "BYTES", "FP64",  "BOOL", "UINT8", "fp32",
          "bf16",  "FP32 ", " FP16", "",     "FP",    "FP322"};
      input->set_datatype(e.OneIn(4) ? (e.OneIn(2) ? std::string("BF16\0", 5) : OddString(e))
                                     : std::string(PickOf(e, kDatatypes)));
      return true;
    }
    case Mutation::kDatatypeSwap: {
      if (!input) return false;
      static constexpr std::array<std::string_view, 3> kAccepted = {"FP32", "BF16", "FP16"};
      input->set_datatype(std::string(PickOf(e, kAccepted)));
      return true;
    }
    case Mutation::kRank: {
      if (!input) return false;
      static constexpr std::array<int, 7> kRanks = {0, 1, 2, 4, 5, 10, 10000};
      const int rank = PickOf(e, kRanks);
      const std::array<int64_t, 3> fill = {1, 7, hidden};
      while (input->shape_size() > rank) input->mutable_shape()->RemoveLast();
      while (input->shape_size() < rank) input->add_shape(PickOf(e, fill));
      return true;
    }
    case Mutation::kDimension: {
      if (!input) return false;
      const std::array<int64_t, 15> dims = {0,
                                            -1,
                                            -hidden,
                                            kInt64Min,
                                            kInt64Max,
                                            int64_t{1} << 31,
                                            (int64_t{1} << 31) - 1,
                                            int64_t{1} << 32,
                                            int64_t{1} << 53,
                                            int64_t{1} << 62,
                                            hidden - 1,
                                            hidden + 1,
                                            2 * hidden,
                                            c.model.max_batch_tokens + 1,
                                            static_cast<int64_t>(e.Below(kUint64Max))};
      if (input->shape_size() == 0) input->add_shape(1);
      input->set_shape(static_cast<int>(e.Below(static_cast<uint64_t>(input->shape_size()))),
                       PickOf(e, dims));
      return true;
    }
    case Mutation::kNegativePair: {
      if (!input || input->shape_size() < 2) return false;
      const int first = static_cast<int>(e.Below(static_cast<uint64_t>(input->shape_size())));
      const int second =
          (first + 1 + static_cast<int>(e.Below(static_cast<uint64_t>(input->shape_size() - 1)))) %
          input->shape_size();
      for (const int i : {first, second}) {
        // -INT64_MIN does not exist; such a dimension keeps its value.
        if (input->shape(i) != kInt64Min) input->set_shape(i, -input->shape(i));
      }
      return true;
    }
    case Mutation::kOverflow: {
      if (!input) return false;
      input->clear_shape();
      // m = hidden x element size is a power of two for every model the
      // generator makes, so 2^64 / m is whole: a dimension of
      // n + 2^64 / m makes the byte count n x m modulo 2^64, exactly the raw
      // bytes a valid request of n tokens carries.
      const Int128 wrap = (Int128{1} << 64) / (hidden * element_bytes);
      const int64_t raw_tokens = request.raw_input_contents_size() > 0
                                     ? static_cast<int64_t>(request.raw_input_contents(0).size()) /
                                           (hidden * element_bytes)
                                     : 1;
      std::array<int64_t, 3> shape = {1, 1, hidden};
      // B x T = 2^64 + n tokens, n tokens modulo 2^64 (the raw bytes'
      // count), for the smallest B from 3 (T below 2^63) that divides it,
      // when one below 64 does.
      const Int128 wrapped_tokens = (Int128{1} << 64) + raw_tokens;
      int64_t divisor = 3;
      while (divisor < 64 && wrapped_tokens % divisor != 0) ++divisor;
      switch (e.Below(6)) {
        case 0:  // B x T = 2^64 wraps to 0 tokens
          shape = {int64_t{1} << 32, int64_t{1} << 32, hidden};
          break;
        case 1:  // T x hidden overflows
          shape = {1, kInt64Max / hidden + 1, hidden};
          break;
        case 2:  // only the element size takes it past 2^63
          shape = {1, kInt64Max / (hidden * element_bytes) + 1, hidden};
          break;
        case 3:  // B x T wraps to the raw bytes' token count
          shape = {divisor, static_cast<int64_t>(wrapped_tokens / divisor), hidden};
          break;
        case 4:  // wraps to the byte count through T
          shape = {1, static_cast<int64_t>(raw_tokens + wrap), hidden};
          break;
        default:  // wraps to the byte count through B
          shape = {static_cast<int64_t>(raw_tokens + wrap), 1, hidden};
          break;
      }
      for (const int64_t dim : shape) input->add_shape(dim);
      return true;
    }
    case Mutation::kByteCount: {
      if (request.raw_input_contents_size() == 0) return false;
      std::string& raw = *request.mutable_raw_input_contents(0);
      const int64_t size = static_cast<int64_t>(raw.size());
      const std::array<int64_t, 6> sizes = {
          size - 1, size + 1, size - element_bytes, size + element_bytes, 0, 2 * size};
      raw.resize(static_cast<size_t>(std::max<int64_t>(0, PickOf(e, sizes))), 'b');
      return true;
    }
    case Mutation::kInputs:
      switch (e.Below(4)) {
        case 0:
          request.clear_inputs();
          break;
        case 1:
          if (!input) return false;
          *request.add_inputs() = *input;
          break;
        default: {
          auto* other = request.add_inputs();
          other->set_name("attention_mask");
          other->set_datatype("INT64");
          other->add_shape(1);
          other->add_shape(1);
          // Half the time before hidden_states, so neither position is special.
          if (e.OneIn(2)) request.mutable_inputs()->SwapElements(0, request.inputs_size() - 1);
          break;
        }
      }
      return true;
    case Mutation::kRawContents:
      switch (e.Below(3)) {
        case 0:
          request.clear_raw_input_contents();
          break;
        case 1:
          if (request.raw_input_contents_size() == 0) return false;
          request.add_raw_input_contents(request.raw_input_contents(0));
          break;
        default:
          request.add_raw_input_contents("");
          break;
      }
      return true;
    case Mutation::kTypedContents: {
      if (!input) return false;
      auto* contents = input->mutable_contents();  // set, even if left empty
      switch (e.Below(3)) {
        case 0:
          break;
        case 1:
          for (int i = 0; i < 16; ++i) contents->add_fp32_contents(0.5f * static_cast<float>(i));
          break;
        default:
          contents->add_bytes_contents("\x01\x02");
          break;
      }
      if (e.OneIn(2)) request.clear_raw_input_contents();
      return true;
    }
    case Mutation::kInputName: {
      if (!input) return false;
      static constexpr std::array<std::string_view, 4> kNames = {"HIDDEN_STATES", "hidden_state",
                                                                 "hidden_states ", "input_ids"};
      input->set_name(e.OneIn(2) ? std::string(PickOf(e, kNames)) : OddString(e));
      return true;
    }
    case Mutation::kModel: {
      static constexpr std::array<std::string_view, 4> kNames = {"demo2", "Demo", "", "demo "};
      static constexpr std::array<std::string_view, 4> kVersions = {"2", "0", "01", "1 "};
      if (e.OneIn(2)) {
        request.set_model_name(e.OneIn(2) ? std::string(PickOf(e, kNames)) : OddString(e));
      } else {
        request.set_model_version(e.OneIn(2) ? std::string(PickOf(e, kVersions)) : OddString(e));
      }
      return true;
    }
    case Mutation::kOutputs: {
      static constexpr std::array<std::string_view, 3> kNames = {"hidden_states", "logits", ""};
      if (e.OneIn(3)) {
        request.add_outputs()->set_name(OddString(e));
        return true;
      }
      // Many outputs, all of them the right one, is still a valid request.
      const std::string_view name = PickOf(e, kNames);
      for (int i = e.OneIn(4) ? 1000 : 1; i > 0; --i) {
        request.add_outputs()->set_name(std::string(name));
      }
      return true;
    }
    case Mutation::kParameter:
      SetRandomValue(e, &(*request.mutable_parameters())[ParameterName(e)]);
      return true;
    case Mutation::kRequestId:
      request.set_id(OddString(e));
      return true;
    case Mutation::kTensorParameters: {
      if (!input) return false;
      const std::string name = e.OneIn(2) ? "binary_data_size" : OddString(e);
      SetRandomValue(e, &(*input->mutable_parameters())[name]);
      return true;
    }
    case Mutation::kByteFlip: {
      std::string bytes;
      // protobuf logs every string field with invalid UTF-8 it serializes or
      // parses; the generator makes thousands on purpose.
      const google::protobuf::LogSilencer quiet;
      request.SerializeToString(&bytes);
      const auto position = [&] { return static_cast<size_t>(e.Below(bytes.size() + 1)); };
      switch (bytes.empty() ? 3 : e.Below(5)) {
        case 0:  // flip 1..8 bits
          for (int64_t i = e.InRange(1, 8); i > 0; --i) {
            bytes[e.Below(bytes.size())] ^= static_cast<char>(1 << e.Below(8));
          }
          break;
        case 1:  // overwrite 1..4 bytes
          for (int64_t i = e.InRange(1, 4); i > 0; --i) {
            bytes[e.Below(bytes.size())] = static_cast<char>(e.Below(256));
          }
          break;
        case 2:  // truncate
          bytes.resize(position());
          break;
        case 3: {  // insert 1..8 random bytes
          std::string extra(static_cast<size_t>(e.InRange(1, 8)), '\0');
          for (char& ch : extra) ch = static_cast<char>(e.Below(256));
          bytes.insert(position(), extra);
          break;
        }
        default: {  // repeat a slice (protobuf merges repeated fields, keeps the last scalar)
          const size_t begin = position();
          const size_t length = static_cast<size_t>(e.Below(bytes.size() - begin + 1));
          bytes.insert(position(), bytes.substr(begin, length));
          break;
        }
      }
      c.unparsable = !request.ParseFromString(bytes);
      return true;
    }
    case Mutation::kCount:
      break;
  }
  return false;
}

// ---------------------------------------------------------------------------
// The oracle.

// What the rules say the path must answer.
struct Expectation {
  absl::StatusCode code = absl::StatusCode::kOk;
  // Words naming each field at fault: a refusal's message must contain one.
  std::vector<std::string> faults;
  // For an accepted request.
  int64_t element_bytes = 0;
  std::optional<SessionParams> session;
  int64_t timeout_us = 0;  // the "timeout" parameter; 0: none
};

// The tensor against validation.h's rules, every one checked (not only the
// first that fails).
void ReadTensor(const ModelInferRequest& request, const ServedModel& model, Expectation* x) {
  const auto fault = [x](std::string words) { x->faults.push_back(std::move(words)); };
  for (const auto& output : request.outputs()) {
    if (output.name() != kTensor) fault("output");
  }
  if (request.raw_input_contents_size() != 1) fault("raw_input_contents");
  if (request.inputs_size() != 1) return fault("inputs");
  const auto& input = request.inputs(0);
  if (input.name() != kTensor) fault("unexpected input");
  if (input.has_contents()) fault("'contents'");
  const std::optional<int64_t> element_bytes = ElementBytes(input.datatype());
  if (!element_bytes) fault("datatype");
  x->element_bytes = element_bytes.value_or(0);
  if (input.shape_size() != 3) return fault("rank");
  bool dims_ok = true;
  for (int i = 0; i < 3; ++i) {
    if (input.shape(i) < 1) {
      fault(absl::StrCat("dimension ", i));
      dims_ok = false;
    }
  }
  const int64_t batch = input.shape(0), tokens = input.shape(1), hidden = input.shape(2);
  if (hidden != model.config.hidden_size) fault("hidden");
  if (!dims_ok) return;
  // Each factor is below 2^63, so every product is checked against 2^63
  // before the next multiplication could leave 128 bits.
  const Int128 total_tokens = Int128{batch} * tokens;
  const Int128 elements = total_tokens <= kInt64Max ? total_tokens * hidden : Int128{kInt64Max} + 1;
  const Int128 bytes = elements <= kInt64Max ? elements * std::max<int64_t>(1, x->element_bytes)
                                             : Int128{kInt64Max} + 1;
  if (bytes > kInt64Max) fault("overflow");
  if (total_tokens > model.max_batch_tokens) fault("--max-batch-tokens");
  if (element_bytes && bytes <= kInt64Max && request.raw_input_contents_size() == 1 &&
      Int128{static_cast<int64_t>(request.raw_input_contents(0).size())} != bytes) {
    fault("raw_input_contents");
  }
}

// The parameters against request_convert.h's rules (ParseSessionParameters,
// TimeoutParameterDeadline): every one is read whether or not a sequence is
// named; names other than these are ignored.
void ReadParameters(const ModelInferRequest& request, Expectation* x) {
  const auto& parameters = request.parameters();
  const auto fault = [x](std::string_view name) {
    x->faults.push_back(absl::StrCat("'", ToAbsl(name), "'"));
  };
  const auto find = [&](const char* name) -> const InferParameter* {
    const auto it = parameters.find(name);
    return it == parameters.end() ? nullptr : &it->second;
  };
  std::optional<SessionId> id;
  if (const InferParameter* p = find("sequence_id")) {
    switch (p->parameter_choice_case()) {
      case InferParameter::kInt64Param:
        if (p->int64_param() != 0) id = SessionId(p->int64_param());
        break;
      case InferParameter::kUint64Param:
        // Triton's correlation ids: uint64 2^64 - k names int64 -k.
        if (p->uint64_param() != 0) {
          id = SessionId(p->uint64_param() > static_cast<uint64_t>(kInt64Max)
                             ? -static_cast<int64_t>(kUint64Max - p->uint64_param()) - 1
                             : static_cast<int64_t>(p->uint64_param()));
        }
        break;
      case InferParameter::kStringParam:
        if (p->string_param().size() > kMaxSequenceIdBytes) {
          fault("sequence_id");
        } else if (!p->string_param().empty()) {
          id = SessionId(p->string_param());
        }
        break;
      default:
        fault("sequence_id");
        break;
    }
  }
  const auto flag = [&](const char* name) {
    const InferParameter* p = find(name);
    if (p == nullptr) return false;
    if (p->parameter_choice_case() == InferParameter::kBoolParam) return p->bool_param();
    fault(name);
    return false;
  };
  const bool start = flag("sequence_start");
  const bool end = flag("sequence_end");
  std::optional<int64_t> position;
  if (const InferParameter* p = find("sequence_position")) {
    if (p->parameter_choice_case() == InferParameter::kInt64Param && p->int64_param() >= 0) {
      position = p->int64_param();
    } else if (p->parameter_choice_case() == InferParameter::kUint64Param &&
               p->uint64_param() <= static_cast<uint64_t>(kInt64Max)) {
      position = static_cast<int64_t>(p->uint64_param());
    } else {
      fault("sequence_position");
    }
  }
  if (id) {
    x->session = SessionParams{.id = *id, .start = start, .end = end, .position = position};
  } else {
    // State asked for without naming the session.
    if (start) fault("sequence_start");
    if (end) fault("sequence_end");
    if (position) fault("sequence_position");
  }
  if (const InferParameter* p = find("timeout")) {
    if (p->parameter_choice_case() == InferParameter::kInt64Param && p->int64_param() >= 0) {
      x->timeout_us = p->int64_param();
    } else {
      fault("timeout");
    }
  }
}

Expectation Expect(const FuzzCase& c) {
  Expectation x;
  const ModelInferRequest& request = c.request;
  if (request.model_name() != c.model.name ||
      (!request.model_version().empty() && request.model_version() != c.model.version)) {
    x.code = absl::StatusCode::kNotFound;
    x.faults = {"model"};
    return x;
  }
  ReadTensor(request, c.model, &x);
  ReadParameters(request, &x);
  if (!x.faults.empty()) {
    x.code = absl::StatusCode::kInvalidArgument;
  } else if (x.session && !c.model.sessions) {
    x.code = absl::StatusCode::kFailedPrecondition;
    x.faults = {"sequence_id"};
  }
  return x;
}

// ---------------------------------------------------------------------------
// The judge.

using Violation = std::function<void(std::string)>;

void JudgeRefusal(const Expectation& x, const absl::Status& status, const Violation& violate) {
  const absl::string_view message = status.message();
  if (message.empty()) violate("the refusal has no message");
  // Built short (base/echo.h), so that the edge's cap never has to cut.
  if (message.size() > kMaxStatusMessageBytes) {
    violate(absl::StrCat("the message has ", message.size(), " bytes, more than ",
                         kMaxStatusMessageBytes, " (kMaxStatusMessageBytes)"));
  }
  const bool names_a_fault = std::any_of(x.faults.begin(), x.faults.end(), [&](const auto& words) {
    return absl::StrContains(message, words);
  });
  if (!names_a_fault) {
    violate(absl::StrCat("the message names none of the fields at fault {",
                         absl::StrJoin(x.faults, ", "), "}"));
  }
  const grpc::Status sent = ToGrpcStatus(status);
  if (static_cast<int>(sent.error_code()) != static_cast<int>(status.code()) ||
      (message.size() <= kMaxStatusMessageBytes && sent.error_message() != message)) {
    violate("the gRPC status sent differs from the core's");
  }
}

// Where the deadline of an accepted request must be.
void JudgeDeadline(const FuzzCase& c, const Expectation& x, const InferRequest& made,
                   SteadyTime now, const Violation& violate) {
  // request_convert.cc clamps waits at a century; this side only needs to
  // know that anything from 99 years on is "far".
  constexpr std::chrono::hours kFar(24 * 365 * 99);
  std::optional<SteadyTime> exact;
  if (c.transport_timeout) exact = now + *c.transport_timeout;
  const std::chrono::microseconds timeout(x.timeout_us);
  const bool far_timeout = x.timeout_us > 0 && timeout >= kFar;
  if (x.timeout_us > 0 && !far_timeout && (!exact || now + timeout < *exact)) exact = now + timeout;
  if (exact) {
    if (made.deadline != exact) violate("the deadline is not the earlier of transport and timeout");
  } else if (far_timeout) {
    if (!made.deadline || *made.deadline < now + kFar || *made.deadline > now + kFar * 2) {
      violate("a timeout of a century or more is not a deadline about a century away");
    }
  } else if (made.deadline) {
    violate("a request without timeout or transport deadline has a deadline");
  }
}

void JudgeAccepted(const FuzzCase& c, const Expectation& x, const InferRequest& made,
                   SteadyTime now, const Violation& violate) {
  const auto& input = c.request.inputs(0);
  const std::string& raw = c.request.raw_input_contents(0);
  if (made.id != c.request.id()) violate("the request id is not echoed");
  if (made.batch != input.shape(0) || made.seq_len != input.shape(1) ||
      made.hidden != input.shape(2)) {
    violate("the core request's shape is not the tensor's");
  } else if (Int128{made.batch} * made.seq_len * made.hidden * x.element_bytes !=
             static_cast<Int128>(made.input.size())) {
    // The shape is the one the oracle found below 2^63 bytes, so the product
    // stays far inside 128 bits.
    violate("B x T x hidden x element size is not the byte count");
  }
  if (static_cast<int64_t>(DTypeSize(made.dtype)) != x.element_bytes ||
      DTypeProtocolName(made.dtype) != input.datatype()) {
    violate("the core request's datatype is not the tensor's");
  }
  if (made.input.data() != raw.data() || made.input.size() != raw.size()) {
    violate("the input does not view raw_input_contents[0]");
  }
  if (made.hidden != c.model.config.hidden_size || made.tokens() > c.model.max_batch_tokens) {
    violate("accepted past the model's limits");
  }
  if (made.session.has_value() != x.session.has_value()) {
    violate(x.session ? "the session was dropped" : "a stateless request got a session");
  } else if (x.session &&
             (made.session->id != x.session->id || made.session->start != x.session->start ||
              made.session->end != x.session->end ||
              made.session->position != x.session->position)) {
    violate("the session is not the one the parameters name");
  }
  JudgeDeadline(c, x, made, now, violate);
}

}  // namespace

FuzzCase GenerateCase(Entropy& e) {
  FuzzCase c;
  c.model = RandomModel(e);
  BuildValidRequest(e, c.model, &c.request);
  if (e.OneIn(3)) c.transport_timeout = std::chrono::microseconds(e.InRange(1, 3'600'000'000));
  // A fifth valid; the rest up to three structural mutations, and a quarter
  // of those serialized, damaged and parsed again.
  if (e.OneIn(5)) return c;
  for (int64_t i = e.InRange(1, 3); i > 0; --i) {
    const auto mutation = static_cast<Mutation>(e.Below(kMutationCount - 1));
    if (Mutate(mutation, e, c)) c.mutations.push_back(mutation);
  }
  if (e.OneIn(4) && Mutate(Mutation::kByteFlip, e, c)) c.mutations.push_back(Mutation::kByteFlip);
  return c;
}

CheckOutcome JudgeOutcome(const FuzzCase& c,
                          const absl::StatusOr<std::unique_ptr<InferRequest>>& made,
                          SteadyTime now) {
  const Expectation x = Expect(c);
  CheckOutcome outcome;
  outcome.code = made.ok() ? absl::StatusCode::kOk : made.status().code();
  const Violation violate = [&outcome](std::string what) {
    if (outcome.violation.empty()) outcome.violation = std::move(what);
  };
  if (outcome.code != x.code) {
    violate(absl::StrCat("answered ", absl::StatusCodeToString(outcome.code),
                         made.ok()
                             ? std::string()
                             : absl::StrCat(" (\"", made.status().message().substr(0, 300), "\")"),
                         "; the rules say ", absl::StatusCodeToString(x.code), " {",
                         absl::StrJoin(x.faults, ", "), "}"));
  } else if (!made.ok()) {
    JudgeRefusal(x, made.status(), violate);
  } else if (*made == nullptr) {
    violate("OK without a request");
  } else {
    JudgeAccepted(c, x, **made, now, violate);
  }
  return outcome;
}

CheckOutcome CheckRequestPath(const FuzzCase& c) {
  // A fixed instant: deadlines are compared exactly.
  const SteadyTime now = SteadyTime() + std::chrono::hours(1000);
  std::optional<SteadyTime> transport_deadline;
  if (c.transport_timeout) transport_deadline = now + *c.transport_timeout;
  // InferHandler::Submit's order: the model first, then the request.
  const absl::Status model = CheckModel(c.model, c.request.model_name(), c.request.model_version());
  const absl::StatusOr<std::unique_ptr<InferRequest>> made =
      model.ok() ? MakeInferRequest(c.request, c.model, LimitsOf(c.model), transport_deadline, now)
                 : absl::StatusOr<std::unique_ptr<InferRequest>>(model);
  return JudgeOutcome(c, made, now);
}

std::string ShortDescription(const inference::ModelInferRequest& request, size_t max_bytes) {
  std::string text = request.ShortDebugString();
  if (text.size() > max_bytes) {
    text = absl::StrCat(text.substr(0, max_bytes), "...(", text.size() - max_bytes, " more bytes)");
  }
  return text;
}

}  // namespace layerserve::fuzz
