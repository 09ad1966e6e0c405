#include "server/cuda/stream_slot.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace layerserve::cuda {
namespace {

// Graphs each stream keeps (its most recently used batch keys). A decode
// load meets one key per batch size it forms, at most a few dozen below
// 256 tokens, each graph a few kilobytes of driver state.
constexpr size_t kGraphsPerStream = 128;

}  // namespace

absl::StatusOr<std::unique_ptr<StreamSlot>> MakeStreamSlot(int index, const LayerShape& shape,
                                                           const StreamSlotOptions& options) {
  auto slot = std::make_unique<StreamSlot>();
  slot->index = index;
  slot->copy_pool =
      std::make_unique<ThreadPool>(std::max(1, options.copy_threads), absl::StrCat("copy", index));
  slot->graphs = std::make_unique<ForwardGraphs>(kGraphsPerStream);
  const size_t t = static_cast<size_t>(options.max_tokens);
  // Inputs of the widest wire dtype (fp32).
  const size_t io_bytes = t * static_cast<size_t>(shape.hidden) * sizeof(float);
  LS_ASSIGN_OR_RETURN(slot->stream, CreateStream());
  LS_ASSIGN_OR_RETURN(
      slot->done,
      CreateEvent(cudaEventDisableTiming | (options.blocking_wait ? cudaEventBlockingSync : 0u)));
  LS_ASSIGN_OR_RETURN(slot->arena,
                      ActivationArena::Create(shape, options.max_tokens, options.num_layers));
  if (shape.experts > 0) {
    LS_ASSIGN_OR_RETURN(slot->expert_tokens_host,
                        PinnedBuffer::Allocate(static_cast<size_t>(options.num_layers) *
                                               shape.experts * sizeof(int32_t)));
  }
  LS_ASSIGN_OR_RETURN(slot->io_device, DeviceBuffer::Allocate(io_bytes));
  LS_ASSIGN_OR_RETURN(slot->io_host, PinnedBuffer::Allocate(io_bytes));
  LS_ASSIGN_OR_RETURN(slot->meta_host, PinnedBuffer::Allocate((2 * t + 1) * sizeof(int32_t)));
  LS_ASSIGN_OR_RETURN(slot->workspace, DeviceBuffer::Allocate(options.workspace_bytes));
  LS_ASSIGN_OR_RETURN(slot->timer, OpTimer::Create(options.num_layers * kOpsPerLayer));
  return slot;
}

}  // namespace layerserve::cuda
