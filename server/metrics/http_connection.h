// One accepted connection of the metrics endpoint (metrics_http.cc), plain or
// TLS, whose every read and write is bounded by a deadline; and HeadStream,
// the httplib::Stream through which httplib parses its request and writes
// the reply.
//
// Deadlines rather than socket timeouts: SO_RCVTIMEO, like httplib's own read
// timeout, bounds each recv() alone, so a client that sends a byte a second
// is never timed out. A deadline bounds the whole head, however it trickles.
// Internal to layerserve_metrics.
#pragma once

#include <httplib.h>
#include <openssl/ssl.h>
#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace layerserve {

using HttpDeadline = std::chrono::steady_clock::time_point;

// Owns an accepted non-blocking socket (and, for HTTPS, its TLS session) and
// closes it on destruction (with a TLS close_notify when the session is up). One thread serves a
// connection; another may only shutdown(2) its fd() to end whatever the serving thread waits for.
class HttpConnection {
 public:
  // `tls`: the endpoint's TLS context for HTTPS, null for plain HTTP.
  HttpConnection(int fd, SSL_CTX* tls);
  ~HttpConnection();
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  int fd() const { return fd_; }

  enum class HeadResult {
    kComplete,  // head() holds the request line and headers, blank line included
    kTooLarge,  // max_bytes came without the blank line
    kTimedOut,  // the deadline passed before the blank line
    kClosed,    // the client closed or reset the connection, or its TLS handshake
                // failed or ran out of time: there is nobody to answer
  };
  // Completes the TLS handshake (HTTPS) and reads the request head: at most
  // `max_bytes`, all by `deadline`.
  HeadResult ReadHead(size_t max_bytes, HttpDeadline deadline);
  // The head that ReadHead completed: up to and including the first empty
  // line after the request line. Bytes read past it (the start of a body) are
  // not part of it.
  std::string_view head() const { return std::string_view(buffer_).substr(0, head_bytes_); }

  // Writes all of `data` by `deadline`; false if the client failed or was too
  // slow to take it. Over HTTPS, only after a ReadHead that got past the
  // handshake.
  bool Write(std::string_view data, HttpDeadline deadline);

  // True if the client sent more than the head (the start of a body, another
  // request), or TLS data that is not read yet: closing now would reset the
  // connection (see FinishAndDrain).
  bool InputPending() const;

  // Ends the connection after a reply: closes this side (TLS close_notify,
  // then a TCP FIN) and discards what the client still sends until it closes
  // too or `deadline` passes. Closing with unread input would make the kernel
  // reset the connection, which can destroy the reply before the client reads
  // it (a 413 sent while the client still uploads its body).
  void FinishAndDrain(HttpDeadline deadline);

  // The numeric address and port of the client (`peer`) or of this end.
  void Address(bool peer, std::string& ip, int& port) const;

 private:
  // Runs `io` (one recv/send, or one SSL_accept/SSL_read/SSL_write) until it
  // makes progress, waiting for the socket as it asks: for `plain_wait` after
  // EAGAIN, or for what OpenSSL wants. Its result (> 0), 0 when the client
  // closed, -1 on an error or at `deadline`.
  template <typename Io>
  ssize_t Retry(Io io, short plain_wait, HttpDeadline deadline);
  // TLS: sends close_notify, once, if the session is up.
  void SendCloseNotify();
  // Waits for `events` on the socket (or a hang-up, or an error) until
  // `deadline`; false at the deadline.
  bool Wait(short events, HttpDeadline deadline) const;

  struct SslFree {
    void operator()(SSL* ssl) const { SSL_free(ssl); }
  };

  const int fd_;
  const bool tls_;                     // HTTPS: ReadHead fails unless the handshake completes
  std::unique_ptr<SSL, SslFree> ssl_;  // null for plain HTTP
  bool ssl_failed_ = false;            // OpenSSL reported a fatal error
  std::string buffer_;                 // what ReadHead read
  size_t head_bytes_ = 0;              // of buffer_, the head
};

// httplib's view of a connection whose head has been read: reads return the
// head and then end of stream, so httplib never reads (or buffers) a byte
// past the bounded head, whatever the request says of a body; writes go to
// the connection, all by one deadline.
class HeadStream final : public httplib::Stream {
 public:
  HeadStream(HttpConnection& connection, HttpDeadline reply_deadline)
      : connection_(connection), unread_(connection.head()), reply_deadline_(reply_deadline) {}

  bool is_readable() const override { return !unread_.empty(); }
  bool is_writable() const override { return true; }  // write() waits, by the deadline
  ssize_t read(char* ptr, size_t size) override;
  using httplib::Stream::write;
  ssize_t write(const char* ptr, size_t size) override;
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    connection_.Address(/*peer=*/true, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    connection_.Address(/*peer=*/false, ip, port);
  }
  socket_t socket() const override { return connection_.fd(); }

 private:
  HttpConnection& connection_;
  std::string_view unread_;  // of the head
  const HttpDeadline reply_deadline_;
};

}  // namespace layerserve
