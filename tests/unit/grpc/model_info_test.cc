// What ModelConfig says about scheduling: Triton's dynamic_batching for a
// stateless model, sequence_batching (oldest strategy, the idle timeout told
// truthfully, the KV cache's numbers as parameters) when sessions are served.
// The field numbers are checked against Triton's model_config.proto, which
// tritonclient and perf_analyzer decode the reply with.
#include "server/grpc/model_info.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

namespace layerserve {
namespace {

ServedModel Model(bool sessions) {
  ServedModel model;
  model.name = "demo";
  model.backend = "cpu";
  model.config.hidden_size = 64;
  model.config.model_type = "llama";
  model.num_layers = 2;
  model.max_batch_tokens = 4096;
  model.max_queue_delay_us = 250;
  model.max_queue_size = 77;
  if (sessions) {
    model.sessions = true;
    model.kv_block_tokens = 16;
    model.kv_blocks = 1000;
    model.kv_cache_dtype = KvCacheDType::kFp8E4M3;
    model.max_sessions = 128;
    model.max_session_tokens = 8192;
    model.session_idle_timeout_us = 30'000'000;
  }
  return model;
}

std::string Parameter(const inference::ModelConfig& config, const std::string& key) {
  const auto it = config.parameters().find(key);
  return it == config.parameters().end() ? "<absent>" : it->second.string_value();
}

TEST(ModelConfigTest, StatelessModelHasTheDynamicBatcher) {
  inference::ModelConfig config;
  FillModelConfig(Model(false), &config);
  ASSERT_EQ(config.scheduling_choice_case(), inference::ModelConfig::kDynamicBatching);
  EXPECT_FALSE(config.has_sequence_batching());
  EXPECT_EQ(config.dynamic_batching().max_queue_delay_microseconds(), 250u);
  EXPECT_EQ(config.dynamic_batching().default_queue_policy().max_queue_size(), 77u);
  EXPECT_TRUE(config.dynamic_batching().default_queue_policy().allow_timeout_override());
  for (const char* key : {"kv_block_tokens", "kv_blocks", "kv_cache_dtype", "max_sessions",
                          "max_session_tokens", "session_idle_timeout_us"}) {
    EXPECT_EQ(Parameter(config, key), "<absent>") << key;
  }
  EXPECT_EQ(Parameter(config, "compute_backend"), "cpu");
}

TEST(ModelConfigTest, SessionsAdvertiseTheSequenceBatcher) {
  inference::ModelConfig config;
  FillModelConfig(Model(true), &config);
  ASSERT_EQ(config.scheduling_choice_case(), inference::ModelConfig::kSequenceBatching);
  EXPECT_FALSE(config.has_dynamic_batching());
  const inference::ModelSequenceBatching& batching = config.sequence_batching();
  EXPECT_EQ(batching.max_sequence_idle_microseconds(), 30'000'000u);
  ASSERT_EQ(batching.strategy_choice_case(), inference::ModelSequenceBatching::kOldest);
  EXPECT_EQ(batching.oldest().max_candidate_sequences(), 128);
  EXPECT_EQ(batching.oldest().max_queue_delay_microseconds(), 250u);
  EXPECT_EQ(batching.oldest().preferred_batch_size_size(), 0);
  EXPECT_EQ(Parameter(config, "kv_block_tokens"), "16");
  EXPECT_EQ(Parameter(config, "kv_blocks"), "1000");
  EXPECT_EQ(Parameter(config, "kv_cache_dtype"), "fp8");
  EXPECT_EQ(Parameter(config, "max_sessions"), "128");
  EXPECT_EQ(Parameter(config, "max_session_tokens"), "8192");
  EXPECT_EQ(Parameter(config, "session_idle_timeout_us"), "30000000");
  // The rest of the configuration is as for a stateless model.
  EXPECT_EQ(config.max_batch_size(), 0);
  EXPECT_EQ(config.input_size(), 1);
  EXPECT_FALSE(config.model_transaction_policy().decoupled());
}

TEST(ModelConfigTest, SessionsThatNeverExpireSayTheLargestIdleTime) {
  // Triton reads max_sequence_idle_microseconds 0 as its 1 s default, which
  // would tell clients their sessions vanish after a second's pause.
  ServedModel model = Model(true);
  model.session_idle_timeout_us = 0;
  model.max_sessions = int64_t{1} << 40;  // clamps into the int32 field
  inference::ModelConfig config;
  FillModelConfig(model, &config);
  EXPECT_EQ(config.sequence_batching().max_sequence_idle_microseconds(),
            std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(Parameter(config, "session_idle_timeout_us"), "0");
  EXPECT_EQ(config.sequence_batching().oldest().max_candidate_sequences(),
            std::numeric_limits<int32_t>::max());
}

// Triton's numbers (model_config.proto; checked against tritonclient's
// model_config_pb2): a renumbered field would decode as garbage there.
TEST(ModelConfigTest, FieldNumbersAreTritons) {
  const auto number = [](const google::protobuf::Descriptor* message, const char* field) {
    const google::protobuf::FieldDescriptor* f = message->FindFieldByName(field);
    return f == nullptr ? -1 : f->number();
  };
  const auto* config = inference::ModelConfig::descriptor();
  EXPECT_EQ(number(config, "dynamic_batching"), 11);
  EXPECT_EQ(number(config, "sequence_batching"), 13);
  EXPECT_EQ(config->FindFieldByName("sequence_batching")->containing_oneof()->name(),
            "scheduling_choice");
  const auto* sequence = inference::ModelSequenceBatching::descriptor();
  EXPECT_EQ(number(sequence, "max_sequence_idle_microseconds"), 1);
  EXPECT_EQ(number(sequence, "direct"), 3);
  EXPECT_EQ(number(sequence, "oldest"), 4);
  const auto* direct = inference::ModelSequenceBatching::StrategyDirect::descriptor();
  EXPECT_EQ(number(direct, "max_queue_delay_microseconds"), 1);
  EXPECT_EQ(number(direct, "minimum_slot_utilization"), 2);
  const auto* oldest = inference::ModelSequenceBatching::StrategyOldest::descriptor();
  EXPECT_EQ(number(oldest, "max_candidate_sequences"), 1);
  EXPECT_EQ(number(oldest, "preferred_batch_size"), 2);
  EXPECT_EQ(number(oldest, "max_queue_delay_microseconds"), 3);
  EXPECT_EQ(number(oldest, "preserve_ordering"), 4);
}

// RepositoryIndex: the served model, its state, and the reason while it is
// not ready; with `ready` set, only a ready model.
TEST(RepositoryIndexTest, NamesTheModelAndItsState) {
  const ServedModel model = Model(false);
  inference::RepositoryIndexResponse ready;
  FillRepositoryIndex(model, absl::OkStatus(), /*ready_only=*/true, &ready);
  ASSERT_EQ(ready.models_size(), 1);
  EXPECT_EQ(ready.models(0).name(), "demo");
  EXPECT_EQ(ready.models(0).version(), model.version);
  EXPECT_EQ(ready.models(0).state(), "READY");
  EXPECT_EQ(ready.models(0).reason(), "");

  const absl::Status draining = absl::UnavailableError("the server is shutting down");
  inference::RepositoryIndexResponse all;
  FillRepositoryIndex(model, draining, /*ready_only=*/false, &all);
  ASSERT_EQ(all.models_size(), 1);
  EXPECT_EQ(all.models(0).state(), "UNAVAILABLE");
  EXPECT_EQ(all.models(0).reason(), "the server is shutting down");
  inference::RepositoryIndexResponse only_ready;
  FillRepositoryIndex(model, draining, /*ready_only=*/true, &only_ready);
  EXPECT_EQ(only_ready.models_size(), 0);
}

// Triton's field numbers, which tritonclient's get_model_repository_index
// reads.
TEST(RepositoryIndexTest, FieldNumbersAreTritons) {
  const auto* request = inference::RepositoryIndexRequest::descriptor();
  EXPECT_EQ(request->FindFieldByName("repository_name")->number(), 1);
  EXPECT_EQ(request->FindFieldByName("ready")->number(), 2);
  const auto* entry = inference::RepositoryIndexResponse::ModelIndex::descriptor();
  EXPECT_EQ(entry->FindFieldByName("name")->number(), 1);
  EXPECT_EQ(entry->FindFieldByName("version")->number(), 2);
  EXPECT_EQ(entry->FindFieldByName("state")->number(), 3);
  EXPECT_EQ(entry->FindFieldByName("reason")->number(), 4);
  EXPECT_EQ(inference::RepositoryIndexResponse::descriptor()->FindFieldByName("models")->number(),
            1);
}

}  // namespace
}  // namespace layerserve
