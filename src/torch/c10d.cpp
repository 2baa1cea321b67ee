// tierzero's bridge to torch's c10d: a TCPStore (served by node 0, or torchrun's agent)
// and ProcessGroupGloo communicators over it, with their asynchronous work handles.
// Built with USE_C10D_GLOO against declaration-only stand-ins for the five gloo headers
// ProcessGroupGloo.hpp includes (src/torch/gloo_stub): every gloo type in its layout sits
// behind a pointer that libtorch_cpu.so creates and owns. Every function catches C++
// exceptions and returns -1 with the message in `err`.
#define USE_C10D_GLOO 1
#include "bridge.h"
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <ATen/ATen.h>

#include <chrono>
#include <cstdlib>
#include <sstream>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {
using tz_bridge::fail;
struct Store {
  c10::intrusive_ptr<c10d::Store> store;
};
struct Group {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
};
struct Work {
  c10::intrusive_ptr<c10d::Work> work;
};
c10d::ReduceOp reduce_op(int op) { return op == 0 ? c10d::ReduceOp::SUM : c10d::ReduceOp::AVG; }
}  // namespace

extern "C" {

// A TCPStore at host:port: served here when `is_server` (waiting for nothing), else a
// client of the one there (node 0's, or torchrun's agent store). Connecting retries
// until `timeout_ms`.
int tz_store_new(const char* host, uint16_t port, int is_server, int64_t timeout_ms, void** out, char* err,
                 size_t n) {
  TZ_TRY
  c10d::TCPStoreOptions o;
  o.port = port;
  o.isServer = is_server != 0;
  o.waitWorkers = false;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), o);
  *out = new Store{store};
  TZ_CATCH
}

void tz_store_free(void* store) { delete static_cast<Store*>(store); }

// The port a TCPStore serves or reaches (the one the system chose for a server made with
// port 0).
int tz_store_port(void* store, uint16_t* out, char* err, size_t n) {
  TZ_TRY
  auto* tcp = dynamic_cast<c10d::TCPStore*>(static_cast<Store*>(store)->store.get());
  if (tcp == nullptr) throw std::runtime_error("not a TCPStore");
  *out = tcp->getPort();
  TZ_CATCH
}

// key := value (bytes).
int tz_store_set(void* store, const char* key, const uint8_t* value, size_t len, char* err, size_t n) {
  TZ_TRY
  std::vector<uint8_t> v(value, value + len);
  static_cast<Store*>(store)->store->set(std::string(key), v);
  TZ_CATCH
}

// Atomically adds `delta` to the counter at `key` (0 when unset); *out gets the sum.
int tz_store_add(void* store, const char* key, int64_t delta, int64_t* out, char* err, size_t n) {
  TZ_TRY
  *out = static_cast<Store*>(store)->store->add(std::string(key), delta);
  TZ_CATCH
}

// Whether `key` is set (without waiting).
int tz_store_check(void* store, const char* key, int* out, char* err, size_t n) {
  TZ_TRY
  *out = static_cast<Store*>(store)->store->check({std::string(key)}) ? 1 : 0;
  TZ_CATCH
}

// The value of `key` into out (up to cap bytes; *len gets its length), waiting for it
// up to the store's timeout.
int tz_store_get(void* store, const char* key, uint8_t* out, size_t cap, size_t* len, char* err, size_t n) {
  TZ_TRY
  auto v = static_cast<Store*>(store)->store->get(std::string(key));
  *len = v.size();
  std::memcpy(out, v.data(), std::min(cap, v.size()));
  TZ_CATCH
}

// A Gloo communicator of `world` ranks over the store, its keys under `prefix`; every
// collective fails after `timeout_ms` without progress.
int tz_gloo_new(void* store, const char* prefix, int rank, int world, int64_t timeout_ms, void** out, char* err,
                size_t n) {
  TZ_TRY
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), static_cast<Store*>(store)->store);
  auto opts = c10d::ProcessGroupGloo::Options::create_default(std::chrono::milliseconds(timeout_ms));
  // as torch.distributed does: GLOO_SOCKET_IFNAME (comma-separated) picks the interfaces,
  // else the hostname's address (or loopback when it does not resolve)
  if (const char* names = std::getenv("GLOO_SOCKET_IFNAME")) {
    std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
    std::stringstream list(names);
    std::string name;
    while (std::getline(list, name, ',')) {
      if (!name.empty()) devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
    }
    if (!devices.empty()) opts->devices = devices;
  }
  auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, world, opts);
  *out = new Group{pg};
  TZ_CATCH
}

void tz_gloo_free(void* group) { delete static_cast<Group*>(group); }

// out (world × in) := every rank's `in`, in rank order.
int tz_gloo_all_gather(void* group, at::Tensor* out, at::Tensor* in, void** work, char* err, size_t n) {
  TZ_TRY
  c10d::Backend& b = *static_cast<Group*>(group)->pg;
  *work = new Work{b._allgather_base(*out, *in)};
  TZ_CATCH
}

// out := this rank's slice of the reduction of `in` over ranks (op 0 sum, 1 average).
int tz_gloo_reduce_scatter(void* group, at::Tensor* out, at::Tensor* in, int op, void** work, char* err,
                           size_t n) {
  TZ_TRY
  c10d::Backend& b = *static_cast<Group*>(group)->pg;
  c10d::ReduceScatterOptions o;
  o.reduceOp = reduce_op(op);
  *work = new Work{b._reduce_scatter_base(*out, *in, o)};
  TZ_CATCH
}

int tz_gloo_all_reduce(void* group, at::Tensor* data, int op, void** work, char* err, size_t n) {
  TZ_TRY
  c10d::Backend& b = *static_cast<Group*>(group)->pg;
  std::vector<at::Tensor> v{*data};
  c10d::AllreduceOptions o;
  o.reduceOp = reduce_op(op);
  *work = new Work{b.allreduce(v, o)};
  TZ_CATCH
}

int tz_gloo_broadcast(void* group, at::Tensor* data, int root, void** work, char* err, size_t n) {
  TZ_TRY
  c10d::Backend& b = *static_cast<Group*>(group)->pg;
  std::vector<at::Tensor> v{*data};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  *work = new Work{b.broadcast(v, o)};
  TZ_CATCH
}

int tz_gloo_barrier(void* group, void** work, char* err, size_t n) {
  TZ_TRY
  c10d::Backend& b = *static_cast<Group*>(group)->pg;
  *work = new Work{b.barrier()};
  TZ_CATCH
}

// Waits for a collective; its failure (a peer gone, the timeout) as the error.
int tz_work_wait(void* work, char* err, size_t n) {
  TZ_TRY
  static_cast<Work*>(work)->work->wait();
  TZ_CATCH
}

void tz_work_free(void* work) { delete static_cast<Work*>(work); }

}  // extern "C"
