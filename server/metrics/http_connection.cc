// HttpConnection and HeadStream (http_connection.h): deadline-bounded I/O on
// a non-blocking socket, plain or through OpenSSL.
#include "server/metrics/http_connection.h"

#include <netdb.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

namespace layerserve {
namespace {

// OpenSSL counts in int; a larger write goes in pieces.
constexpr size_t kMaxSslChunk = size_t{1} << 30;

}  // namespace

HttpConnection::HttpConnection(int fd, SSL_CTX* tls) : fd_(fd), tls_(tls != nullptr) {
  if (tls_) {
    ssl_.reset(SSL_new(tls));
    // A session that cannot be made (out of memory) stays null: ReadHead
    // then reports the connection closed, and nothing is ever sent in clear.
    if (ssl_ != nullptr && SSL_set_fd(ssl_.get(), fd_) != 1) ssl_.reset();
  }
}

HttpConnection::~HttpConnection() {
  SendCloseNotify();
  ssl_.reset();
  close(fd_);
}

void HttpConnection::SendCloseNotify() {
  // OpenSSL forbids SSL_shutdown after a fatal error, and before the
  // handshake there is no session to close.
  if (ssl_ == nullptr || ssl_failed_ || !SSL_is_init_finished(ssl_.get()) ||
      (SSL_get_shutdown(ssl_.get()) & SSL_SENT_SHUTDOWN) != 0) {
    return;
  }
  ERR_clear_error();
  SSL_shutdown(ssl_.get());  // one try: the client's close_notify is not awaited
}

bool HttpConnection::Wait(short events, HttpDeadline deadline) const {
  for (;;) {
    const auto left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p = {.fd = fd_, .events = events, .revents = 0};
    const int ready = poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), INT_MAX)));
    // Ready, hung up or failed: the next call on the socket says which.
    if (ready > 0) return true;
    if (ready < 0 && errno != EINTR) return false;
  }
}

template <typename Io>
ssize_t HttpConnection::Retry(Io io, short plain_wait, HttpDeadline deadline) {
  for (;;) {
    ERR_clear_error();  // SSL_get_error reads this thread's error queue
    const ssize_t n = io();
    short wait = 0;
    if (ssl_ == nullptr) {
      if (n >= 0) return n;
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
      wait = plain_wait;
    } else {
      if (n > 0) return n;
      switch (SSL_get_error(ssl_.get(), static_cast<int>(n))) {
        case SSL_ERROR_ZERO_RETURN:  // the client's close_notify
          return 0;
        case SSL_ERROR_WANT_READ:
          wait = POLLIN;
          break;
        case SSL_ERROR_WANT_WRITE:
          wait = POLLOUT;
          break;
        default:  // SSL_ERROR_SYSCALL, SSL_ERROR_SSL: the session is dead
          ssl_failed_ = true;
          return -1;
      }
    }
    if (!Wait(wait, deadline)) return -1;
  }
}

HttpConnection::HeadResult HttpConnection::ReadHead(size_t max_bytes, HttpDeadline deadline) {
  if (tls_ && (ssl_ == nullptr ||
               Retry([this] { return SSL_accept(ssl_.get()); }, /*plain_wait=*/0, deadline) <= 0)) {
    return HeadResult::kClosed;
  }
  buffer_.resize(max_bytes);
  size_t filled = 0;
  while (filled < max_bytes) {
    char* const into = buffer_.data() + filled;
    const size_t room = max_bytes - filled;
    const ssize_t n = Retry(
        [&] {
          return ssl_ != nullptr
                     ? static_cast<ssize_t>(SSL_read(
                           ssl_.get(), into, static_cast<int>(std::min(room, kMaxSslChunk))))
                     : recv(fd_, into, room, 0);
        },
        POLLIN, deadline);
    if (n <= 0)
      return n < 0 && std::chrono::steady_clock::now() >= deadline ? HeadResult::kTimedOut
                                                                   : HeadResult::kClosed;
    // The head ends at the first empty line ("\r\n") after the request line,
    // where httplib's parser ends it too (a line that ends in a bare "\n" is
    // no empty line for it). Search from two bytes back: the three may span
    // two reads.
    const size_t from = filled >= 2 ? filled - 2 : 0;
    filled += static_cast<size_t>(n);
    const size_t end = std::string_view(buffer_.data(), filled).find("\n\r\n", from);
    if (end != std::string_view::npos) {
      buffer_.resize(filled);
      head_bytes_ = end + 3;
      return HeadResult::kComplete;
    }
  }
  return HeadResult::kTooLarge;
}

bool HttpConnection::Write(std::string_view data, HttpDeadline deadline) {
  while (!data.empty()) {
    const size_t size = std::min(data.size(), kMaxSslChunk);
    const ssize_t n = Retry(
        [&] {
          return ssl_ != nullptr ? static_cast<ssize_t>(
                                       SSL_write(ssl_.get(), data.data(), static_cast<int>(size)))
                                 : send(fd_, data.data(), size, MSG_NOSIGNAL);
        },
        POLLOUT, deadline);
    if (n <= 0) return false;
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

bool HttpConnection::InputPending() const {
  int queued = 0;
  return buffer_.size() > head_bytes_ || (ssl_ != nullptr && SSL_pending(ssl_.get()) > 0) ||
         ioctl(fd_, FIONREAD, &queued) != 0 || queued > 0;
}

void HttpConnection::FinishAndDrain(HttpDeadline deadline) {
  SendCloseNotify();
  shutdown(fd_, SHUT_WR);
  // What arrives now is discarded raw (TLS records too): a small buffer, and
  // the deadline bounds how long.
  char discard[4096];
  for (;;) {
    const ssize_t n = recv(fd_, discard, sizeof(discard), 0);
    if (n > 0) continue;
    if (n == 0) return;  // the client closed too
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return;
    if (!Wait(POLLIN, deadline)) return;
  }
}

void HttpConnection::Address(bool peer, std::string& ip, int& port) const {
  sockaddr_storage address = {};
  socklen_t length = sizeof(address);
  sockaddr* const a = reinterpret_cast<sockaddr*>(&address);
  char host[NI_MAXHOST] = "";
  char service[NI_MAXSERV] = "";
  if ((peer ? getpeername(fd_, a, &length) : getsockname(fd_, a, &length)) != 0 ||
      getnameinfo(a, length, host, sizeof(host), service, sizeof(service),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    ip.clear();
    port = -1;
    return;
  }
  ip = host;
  port = std::atoi(service);
}

ssize_t HeadStream::read(char* ptr, size_t size) {
  const size_t n = std::min(size, unread_.size());
  std::memcpy(ptr, unread_.data(), n);
  unread_.remove_prefix(n);
  return static_cast<ssize_t>(n);
}

ssize_t HeadStream::write(const char* ptr, size_t size) {
  return connection_.Write(std::string_view(ptr, size), reply_deadline_)
             ? static_cast<ssize_t>(size)
             : -1;
}

}  // namespace layerserve
