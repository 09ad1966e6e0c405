// Names for the server's threads, as `top -H`, /proc/PID/task/*/comm and
// debuggers show them: the request path's threads are told apart by name
// (grpc-cq-0, batcher, reply-2, stream-1, ...), which is how
// bench/server/launch_rows.py --threads charges each one's CPU time to a
// role.
#pragma once

#include <string>
#include <string_view>

namespace layerserve {

// Names the calling thread. Linux keeps 15 bytes of a name: a longer one is
// cut there, so keep names short and put the distinguishing index last
// within the first 15 bytes.
void NameThisThread(std::string_view name);

// The calling thread's name (empty where the platform cannot say).
std::string ThisThreadName();

}  // namespace layerserve
