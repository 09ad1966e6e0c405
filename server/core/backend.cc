// Packing of a batch's sequences into one activation (see backend.h).
#include "server/core/backend.h"

namespace layerserve {

void Batch::Pack() {
  cu_seqlens.clear();
  cu_seqlens.push_back(0);
  int64_t offset = 0;
  for (const auto& request : requests) {
    for (int64_t b = 0; b < request->batch; ++b) {
      offset += request->seq_len;
      cu_seqlens.push_back(static_cast<int32_t>(offset));
    }
  }
  total_tokens = offset;
}

}  // namespace layerserve
