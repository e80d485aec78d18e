// The rendezvous store: a small TCP key-value store through which the workers of a job find each other
// (rank 0 hosts it, or a standalone one named by DISTGRAD_STORE) and synchronise (counters, barriers).
//
// StoreServer runs one thread: poll() over nonblocking sockets plus an eventfd for stop. Requests from one
// client are answered in order; get/wait requests whose keys are missing are parked until a set/add/
// compareSet creates them or their timeout (enforced by the server) expires. Every request field is
// validated (lengths against StoreLimits, opcodes, counts); a malformed request closes that client's
// connection and the server keeps serving everyone else.
//
// Wire protocol (all integers little-endian):
//   request  = u32 bodyBytes | u8 opcode | fields
//   response = u32 bodyBytes | u8 status (0 ok, 1 timeout, 2 error) | fields
//   bytes    = u32 length | length bytes;  keys = u32 count | count x bytes
//   set  key value -> ok            get key u64 timeoutMs -> ok value | timeout
//   add  key i64 delta -> ok i64    compareSet key expected desired -> ok current value
//   check keys -> ok u8             wait keys u64 timeoutMs -> ok | timeout
//   deleteKey key -> ok u8          numKeys -> ok u64
// Error responses carry a message (bytes). Counters are stored as decimal text, so get() on a counter key
// returns e.g. "3" (as in torch.distributed's TCPStore).
//
// StoreClient is synchronous: one request in flight at a time per client (calls from several threads are
// serialised by a mutex; use one client per thread for concurrency). Failures throw rpc::RpcError: kind
// timeout (a get/wait deadline or connect deadline expired; the message names the key(s)), disconnected
// (the server went away; the client is then unusable), failed (the server rejected the request).
// Thread-safety: StoreServer's public methods and StoreClient's methods are safe from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace distgrad::rpc {

// Limits the server enforces on untrusted input before allocating anything.
struct StoreLimits {
  uint32_t maxKeyBytes = 4096;
  uint32_t maxValueBytes = 64u << 20;
  uint32_t maxKeysPerRequest = 65536;
  uint32_t maxClients = 65536;
};

class StoreServer {
 public:
  // Binds "host:port" (port 0 picks a free one; host "0.0.0.0" or "::" listens everywhere) and starts the
  // serving thread. Throws rpc::RpcError (failed) when the address cannot be bound.
  static std::unique_ptr<StoreServer> start(const std::string& address, StoreLimits limits = {});
  ~StoreServer();  // stops the thread and closes every connection
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const { return port_; }
  // "host:port" with the real port, for clients on this machine or others (when host is routable).
  std::string address() const;

  // Number of currently connected clients (for tests and diagnostics).
  size_t clientCount() const { return clientCount_.load(); }
  // Number of get/wait requests currently parked waiting for keys (for tests and diagnostics).
  size_t parkedRequests() const { return parkedRequests_.load(); }
  // Number of connections closed because of malformed input.
  size_t rejectedClients() const { return rejectedClients_.load(); }

 private:
  struct Impl;
  StoreServer() = default;
  void run();

  std::unique_ptr<Impl> impl_;
  std::string host_;
  int port_ = 0;
  std::atomic<size_t> clientCount_{0};
  std::atomic<size_t> rejectedClients_{0};
  std::atomic<size_t> parkedRequests_{0};
  std::thread thread_;
};

class StoreClient {
 public:
  // Connects to "host:port", retrying refused/unreachable connections until `timeout` has passed (the
  // server may not be up yet when a worker starts). Throws RpcError (timeout) naming the address and the
  // last error.
  static std::unique_ptr<StoreClient> connect(const std::string& address, std::chrono::milliseconds timeout);
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  void set(std::string_view key, std::span<const uint8_t> value);
  void set(std::string_view key, std::string_view value);
  // Waits until `key` exists (or `timeout` passes: RpcError timeout naming the key) and returns its value.
  std::vector<uint8_t> get(std::string_view key, std::chrono::milliseconds timeout);
  std::string getString(std::string_view key, std::chrono::milliseconds timeout);
  // Atomically adds `delta` to the counter `key` (created at 0) and returns the new value. Throws RpcError
  // (failed) if the key holds something that is not a decimal integer.
  int64_t add(std::string_view key, int64_t delta);
  // Sets `key` to `desired` if its current value equals `expected` (a missing key matches an empty
  // `expected`). Returns the value after the operation (the current one when the comparison failed; empty
  // when the key is still missing).
  std::vector<uint8_t> compareSet(std::string_view key, std::span<const uint8_t> expected,
                                  std::span<const uint8_t> desired);
  std::string compareSet(std::string_view key, std::string_view expected, std::string_view desired);
  // True when every key exists (does not wait).
  bool check(const std::vector<std::string>& keys);
  // Waits until every key exists; RpcError timeout names the missing keys.
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // Deletes `key`; returns whether it existed.
  bool deleteKey(std::string_view key);
  uint64_t numKeys();

  // Blocks until `worldSize` participants have called barrier(name, worldSize, ...). Reusable: the k-th
  // call of every participant with the same name meets the others' k-th call. Built on add + wait; the last
  // participant to arrive does not wait, so after a final barrier the store's host may shut it down.
  void barrier(std::string_view name, int worldSize, std::chrono::milliseconds timeout);

  const std::string& address() const { return address_; }

 private:
  StoreClient(int fd, std::string address) : fd_(fd), address_(std::move(address)) {}
  // Sends one request body and returns the response body (status byte first). `serverTimeout` is the
  // deadline the server enforces (get/wait); the client waits that long plus a grace period.
  std::vector<uint8_t> roundTrip(const std::vector<uint8_t>& request, std::chrono::milliseconds serverTimeout);

  std::mutex mutex_;
  int fd_ = -1;  // guarded by mutex_; -1 after a disconnect
  std::string address_;
};

}  // namespace distgrad::rpc
