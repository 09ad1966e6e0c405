// An HTTP client on raw POSIX sockets for the metrics endpoint's tests: it can
// do what no HTTP library would (send a head a byte at a time, announce a
// body it never sends, keep sending after the server answered), it bounds a
// whole exchange by one deadline, and it reads until the server closes, so
// that when an exchange returns the server's end of it is closed too.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

namespace layerserve::testing {

// An owned file descriptor, closed on destruction.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~Fd() { Reset(); }
  int get() const { return fd_; }
  void Reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

// A connection to 127.0.0.1:`port`, non-blocking once established; invalid
// (get() < 0) if it could not connect.
inline Fd Connect(int port) {
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    return Fd();
  }
  fcntl(fd.get(), F_SETFL, O_NONBLOCK);
  return fd;
}

// How one exchange went.
struct Answer {
  int status = 0;          // of the server's reply; 0 if none came
  std::string reply;       // all the server sent
  bool closed = false;     // the server closed the connection (else: time ran out)
  double seconds = 0;      // until it closed, or the time limit
  int64_t bytes_sent = 0;  // of the head and body the client meant to send

  // The reply's body (after its head), or "" if none came.
  std::string Body() const {
    const size_t end = reply.find("\r\n\r\n");
    return end == std::string::npos ? "" : reply.substr(end + 4);
  }
};

// Sends `head`, then up to `body_bytes` of zeros, on a fresh connection and
// reads the reply until the server closes the connection or `timeout_seconds`
// pass. The client stops sending as soon as a reply begins, as a client that
// watches for an early answer (curl, a browser) does.
inline Answer Exchange(int port, const std::string& head, int64_t body_bytes,
                       double timeout_seconds) {
  using Clock = std::chrono::steady_clock;
  Answer answer;
  const Clock::time_point start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(timeout_seconds));
  Fd fd = Connect(port);
  if (fd.get() < 0) return answer;
  static const std::string kZeros(64 * 1024, '\0');
  const int64_t to_send = static_cast<int64_t>(head.size()) + body_bytes;
  const int64_t head_bytes = static_cast<int64_t>(head.size());
  bool sending = true;
  char buffer[16 * 1024];
  while (!answer.closed && Clock::now() < deadline) {
    sending = sending && answer.bytes_sent < to_send && answer.reply.empty();
    pollfd p = {.fd = fd.get(), .events = static_cast<short>(POLLIN | (sending ? POLLOUT : 0))};
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (poll(&p, 1, static_cast<int>(left.count()) + 1) <= 0) continue;
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t n = recv(fd.get(), buffer, sizeof(buffer), 0);
      if (n > 0) {
        answer.reply.append(buffer, static_cast<size_t>(n));
        continue;
      }
      // Closed, or reset (a server that closes with input unread).
      if (n == 0 || (errno != EAGAIN && errno != EINTR)) answer.closed = true;
    }
    if (sending && (p.revents & POLLOUT)) {
      const int64_t at = answer.bytes_sent;
      const char* data = at < head_bytes ? head.data() + at : kZeros.data();
      const int64_t size =
          at < head_bytes ? head_bytes - at : std::min<int64_t>(to_send - at, kZeros.size());
      const ssize_t n = send(fd.get(), data, static_cast<size_t>(size), MSG_NOSIGNAL);
      if (n > 0) answer.bytes_sent += n;
      if (n < 0 && errno != EAGAIN && errno != EINTR) sending = false;  // the server closed
    }
  }
  answer.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (answer.reply.rfind("HTTP/1.", 0) == 0 && answer.reply.size() >= 12) {
    answer.status = std::atoi(answer.reply.substr(9, 3).c_str());
  }
  return answer;
}

// GET `path`, the way Prometheus scrapes (one request, then the connection
// closes).
inline Answer Get(int port, const std::string& path, double timeout_seconds = 5.0) {
  return Exchange(port, "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
                  0, timeout_seconds);
}

}  // namespace layerserve::testing
