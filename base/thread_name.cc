// Thread names (see thread_name.h), through pthread's Linux extension.
#include "base/thread_name.h"

#include <pthread.h>

namespace layerserve {

// The kernel's limit (TASK_COMM_LEN), terminator included.
constexpr size_t kNameBytes = 16;

void NameThisThread(std::string_view name) {
  const std::string cut(name.substr(0, kNameBytes - 1));
  // Fails only for a name of 16 bytes or more, which `cut` never is.
  static_cast<void>(pthread_setname_np(pthread_self(), cut.c_str()));
}

std::string ThisThreadName() {
  char name[kNameBytes] = {};
  if (pthread_getname_np(pthread_self(), name, sizeof(name)) != 0) return {};
  return name;
}

}  // namespace layerserve
