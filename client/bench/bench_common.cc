// Shared pieces of the load generators (see bench_common.h).
#include "client/bench/bench_common.h"

#include <algorithm>
#include <cstdio>
#include <random>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace layerserve::client {

ProgressLine::ProgressLine(bool enabled, std::function<std::string()> line)
    : line_(std::move(line)) {
  if (enabled) thread_ = std::thread([this] { Run(); });
}

ProgressLine::~ProgressLine() {
  stop_.Notify();
  if (thread_.joinable()) {
    thread_.join();
    std::fputc('\n', stderr);
  }
}

void ProgressLine::Run() {
  while (!stop_.WaitForNotificationWithTimeout(absl::Seconds(1))) {
    std::fprintf(stderr, "\r%s", line_().c_str());
    std::fflush(stderr);
  }
}

absl::Status StoppedBy(const absl::Status& fatal) {
  absl::Status out(
      fatal.code(),
      absl::StrCat("bench stopped: a request failed with ", absl::StatusCodeToString(fatal.code()),
                   ", which every further request would get too: ", fatal.message()));
  fatal.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

void QueuedInfer::Start(Client& client, const inference::ModelInferRequest& request,
                        absl::Time sent, absl::Duration timeout, grpc::CompletionQueue* cq,
                        void* tag) {
  issued = sent;
  context = std::make_unique<grpc::ClientContext>();
  reader = client.StartInfer(*context, request, issued + timeout, cq);
  reader->Finish(&response, &status, tag);
}

absl::Status QueuedInfer::Outcome() const {
  absl::Status outcome = FromGrpcStatus(status);
  if (outcome.ok()) outcome = Client::CheckOutput(response).status();
  return outcome;
}

void ShutDownQueue(grpc::CompletionQueue& cq) {
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
}

absl::Status CheckBenchDatatype(const std::string& datatype) {
  if (datatype == "FP32" || datatype == "FP16" || datatype == "BF16") return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--datatype must be FP32, FP16 or BF16, not ", datatype));
}

absl::StatusOr<int64_t> HiddenFromMetadata(Client& client, const std::string& model) {
  absl::StatusOr<inference::ModelMetadataResponse> metadata =
      client.ModelMetadata(model, absl::Now() + absl::Seconds(10));
  if (!metadata.ok()) return metadata.status();
  int64_t hidden = 0;
  for (const auto& input : metadata->inputs()) {
    if (input.name() == kHiddenStates && input.shape_size() > 0) {
      hidden = input.shape(input.shape_size() - 1);
    }
  }
  if (hidden <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model ", model, " does not state its hidden size in its metadata; pass --hidden"));
  }
  return hidden;
}

std::vector<Tensor> RandomInputs(const std::vector<int64_t>& shape, const std::string& datatype,
                                 uint64_t seed, size_t count) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int64_t elements = 1;
  for (int64_t dim : shape) elements *= dim;
  // Drawing every element costs ~20 ns each: 1.3 s for two 8192-token
  // prefills of hidden 4096, which a bench process would spend before its
  // first request. So at most kRandomInputPool values are drawn per tensor and
  // a larger one repeats them, each repeat starting at a random point of the
  // pool (still standard normal element by element, just not independent).
  const size_t total = static_cast<size_t>(elements);
  const size_t pool_size = std::min(total, kRandomInputPool);
  std::vector<float> pool(pool_size);
  std::vector<float> values(total);
  std::vector<Tensor> inputs;
  for (size_t i = 0; i < count; ++i) {
    for (float& v : pool) v = normal(rng);
    for (size_t begin = 0; begin < total; begin += pool_size) {
      const size_t offset = begin == 0 ? 0 : static_cast<size_t>(rng() % pool_size);
      const size_t n = std::min(pool_size, total - begin);
      for (size_t j = 0; j < n; ++j) values[begin + j] = pool[(offset + j) % pool_size];
    }
    // Callers check the datatype and shape first, so the conversion succeeds.
    inputs.push_back(*FloatsToTensor(values, shape, datatype));
  }
  return inputs;
}

void CountError(const absl::Status& status, std::map<std::string, int64_t>& counts,
                std::map<std::string, std::string>& first) {
  const std::string code = absl::StatusCodeToString(status.code());
  ++counts[code];
  first.try_emplace(code, std::string(status.message()));
}

std::string FormatErrorLines(const std::map<std::string, int64_t>& counts,
                             const std::map<std::string, std::string>& first) {
  std::string out;
  for (const auto& [code, count] : counts) {
    absl::StrAppend(&out, "errors ", code, ": ", count);
    const auto message = first.find(code);
    if (message != first.end() && !message->second.empty()) {
      absl::StrAppend(&out, " (first: ", message->second, ")");
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

}  // namespace layerserve::client
