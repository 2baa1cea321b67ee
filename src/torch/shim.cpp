// tierzero's bridge to libtorch for what tch does not expose: torch's current stream on
// an accelerator, a non-blocking copy_, autograd::grad with incoming gradients, the
// caching allocator's memory statistics, a counting CPU allocator (libtorch's CPU bytes
// measured where tensors are made) and torch's fused Adam/AdamW kernels. Every function catches C++ exceptions and
// returns -1 with the message in `err` (never throws across the C boundary).
// Tensors are passed as `at::Tensor*`, the same handles tch uses (torch_api.h).
#include "bridge.h"
#include <ATen/ATen.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/autograd.h>

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <vector>

namespace {
using tz_bridge::fail;
// The accelerator's type, with its runtime (and caching allocator) initialised: the
// allocator statistics refuse a device until the first tensor there would have done it.
c10::DeviceType ready_accelerator() {
  c10::DeviceType type = at::accelerator::getAccelerator(true).value();
  at::globalContext().lazyInitDevice(type);
  return type;
}

// Counting CPU allocator: libtorch's own CPU allocator underneath, each block prefixed
// by a 64-byte header holding its size (64 keeps torch's alignment), so the bytes
// libtorch holds on the CPU are known without a table. Context == data, so
// raw_allocate/raw_deleter users work as with the default allocator.
constexpr size_t kHeader = 64;
std::atomic<int64_t> g_cpu_current{0};
std::atomic<int64_t> g_cpu_peak{0};
c10::Allocator* g_cpu_inner = nullptr;
c10::DeleterFnPtr g_cpu_inner_free = nullptr;

void counting_free(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  int64_t size = 0;
  std::memcpy(&size, base, sizeof size);
  g_cpu_current.fetch_sub(size, std::memory_order_relaxed);
  g_cpu_inner_free(base);
}

struct CountingCpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* base = g_cpu_inner->raw_allocate(n + kHeader);
    const int64_t size = static_cast<int64_t>(n);
    std::memcpy(base, &size, sizeof size);
    const int64_t now = g_cpu_current.fetch_add(size, std::memory_order_relaxed) + size;
    int64_t peak = g_cpu_peak.load(std::memory_order_relaxed);
    while (now > peak && !g_cpu_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    void* data = static_cast<char*>(base) + kHeader;
    return {data, data, &counting_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counting_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
CountingCpuAllocator g_counting;
}  // namespace

extern "C" {

// The raw handle (cudaStream_t on CUDA) of the current stream of accelerator
// `device_index`. A null handle is the legacy default stream, a valid value.
// `id` receives torch's id of the stream (for tz_set_current_stream).
int tz_current_stream(int device_index, void** out, int64_t* id, char* err, size_t n) {
  TZ_TRY
  ready_accelerator();
  c10::Stream s = at::accelerator::getCurrentStream(static_cast<c10::DeviceIndex>(device_index));
  *out = reinterpret_cast<void*>(s.native_handle());
  *id = s.id();
  TZ_CATCH
}

// A stream from torch's pool on accelerator `device_index` (non-blocking with respect to
// the legacy default stream; torch owns it for the whole process): its raw handle and id.
int tz_stream_from_pool(int device_index, int high_priority, void** out, int64_t* id, char* err,
                        size_t n) {
  TZ_TRY
  c10::DeviceType type = ready_accelerator();
  c10::impl::VirtualGuardImpl guard(type);
  c10::Stream s = guard.getStreamFromGlobalPool(
      c10::Device(type, static_cast<c10::DeviceIndex>(device_index)), high_priority != 0);
  *out = reinterpret_cast<void*>(s.native_handle());
  *id = s.id();
  TZ_CATCH
}

// Makes stream `id` of accelerator `device_index` the calling thread's current stream
// there (thread-local: torch queues this thread's work for that device on it).
int tz_set_current_stream(int device_index, int64_t id, char* err, size_t n) {
  TZ_TRY
  c10::DeviceType type = ready_accelerator();
  at::accelerator::setCurrentStream(
      c10::Stream::unpack3(id, static_cast<c10::DeviceIndex>(device_index), type));
  TZ_CATCH
}

// A new uninitialised byte tensor of `bytes` bytes in pinned host memory (torch's
// pinned allocator, which knows when its async copies are done).
int tz_pinned_bytes(int64_t bytes, at::Tensor** out, char* err, size_t n) {
  TZ_TRY
  ready_accelerator();
  *out = new at::Tensor(at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true)));
  TZ_CATCH
}

// Queues a kernel that spins for `cycles` GPU clock cycles on the calling thread's current
// stream of device `device_index`: torch's at::cuda::sleep, looked up at run time (libtorch_cuda is loaded only
// with a CUDA build of torch; an error otherwise).
int tz_device_sleep(int device_index, int64_t cycles, char* err, size_t n) {
  TZ_TRY
  using SleepFn = void (*)(int64_t);
  static SleepFn sleep_fn = reinterpret_cast<SleepFn>(dlsym(RTLD_DEFAULT, "_ZN2at4cuda5sleepEl"));
  if (sleep_fn == nullptr) {
    throw std::runtime_error("at::cuda::sleep is not loaded (a CPU build of torch)");
  }
  // it launches on the current device's current stream: make that device current
  c10::DeviceIndex previous = at::accelerator::exchangeDevice(static_cast<c10::DeviceIndex>(device_index));
  sleep_fn(cycles);
  at::accelerator::maybeExchangeDevice(previous);
  TZ_CATCH
}

// Waits for all work on accelerator `device_index`.
int tz_synchronize(int device_index, char* err, size_t n) {
  TZ_TRY
  ready_accelerator();
  at::accelerator::synchronizeDevice(static_cast<c10::DeviceIndex>(device_index));
  TZ_CATCH
}

// dst.copy_(src, non_blocking).
int tz_copy(at::Tensor* dst, const at::Tensor* src, int non_blocking, char* err, size_t n) {
  TZ_TRY
  dst->copy_(*src, non_blocking != 0);
  TZ_CATCH
}

// torch::autograd::grad(outputs, inputs, grad_outputs): writes n_in new tensors to
// `result` (owned by the caller, released with tz_free). An input the outputs do not
// depend on gets an undefined tensor (allow_unused).
int tz_grad(at::Tensor** outputs, at::Tensor** grad_outputs, int n_out, at::Tensor** inputs,
            int n_in, int keep_graph, at::Tensor** result, char* err, size_t n) {
  TZ_TRY
  std::vector<at::Tensor> outs, grads, ins;
  for (int i = 0; i < n_out; ++i) {
    outs.push_back(*outputs[i]);
    grads.push_back(*grad_outputs[i]);
  }
  for (int i = 0; i < n_in; ++i) ins.push_back(*inputs[i]);
  auto g = torch::autograd::grad(outs, ins, grads, keep_graph != 0, false, true);
  for (int i = 0; i < n_in; ++i) result[i] = new at::Tensor(std::move(g[i]));
  TZ_CATCH
}

// Caching allocator statistics of accelerator `device_index`: allocated and reserved
// bytes, current and peak since the last reset.
int tz_memory_stats(int device_index, int64_t* out4, char* err, size_t n) {
  TZ_TRY
  ready_accelerator();
  auto stats = at::accelerator::getDeviceStats(static_cast<c10::DeviceIndex>(device_index));
  const size_t all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  out4[0] = stats.allocated_bytes[all].current;
  out4[1] = stats.allocated_bytes[all].peak;
  out4[2] = stats.reserved_bytes[all].current;
  out4[3] = stats.reserved_bytes[all].peak;
  TZ_CATCH
}

int tz_reset_peak(int device_index, char* err, size_t n) {
  TZ_TRY
  ready_accelerator();
  at::accelerator::resetPeakStats(static_cast<c10::DeviceIndex>(device_index));
  TZ_CATCH
}

// torch's fused Adam on one fp32 partition, in place: AdamW (decoupled weight decay) when
// `decoupled`, else Adam with L2 decay; `step` is the 1-based step this update makes
// (the kernel reads state_steps as the current step: torch.optim increments them before
// the call).
int tz_fused_adam(at::Tensor* param, at::Tensor* grad, at::Tensor* exp_avg, at::Tensor* exp_avg_sq,
                  int64_t step, double lr, double beta1, double beta2, double weight_decay,
                  double eps, int decoupled, char* err, size_t n) {
  TZ_TRY
  auto steps = at::full({}, static_cast<double>(step),
                        at::TensorOptions().dtype(at::kFloat).device(param->device()));
  std::vector<at::Tensor> p{*param}, g{*grad}, m{*exp_avg}, v{*exp_avg_sq}, none, t{steps};
  if (decoupled != 0) {
    at::_fused_adamw_(p, g, m, v, none, t, lr, beta1, beta2, weight_decay, eps, false, false);
  } else {
    at::_fused_adam_(p, g, m, v, none, t, lr, beta1, beta2, weight_decay, eps, false, false);
  }
  TZ_CATCH
}

// From now on libtorch's CPU tensors are allocated through the counting allocator
// (once per process; tensors allocated before keep their own deleter).
int tz_count_cpu_allocations(char* err, size_t n) {
  TZ_TRY
  static std::once_flag once;
  std::call_once(once, [] {
    g_cpu_inner = c10::GetCPUAllocator();
    g_cpu_inner_free = g_cpu_inner->raw_deleter();
    TORCH_CHECK(g_cpu_inner_free != nullptr, "libtorch's CPU allocator has no raw deleter");
    c10::SetCPUAllocator(&g_counting, /*priority=*/100);
  });
  TZ_CATCH
}

// Bytes libtorch's CPU tensors hold now and at most since the last reset (counted from
// tz_count_cpu_allocations on).
int tz_cpu_memory_stats(int64_t* out2, char* err, size_t n) {
  TZ_TRY
  out2[0] = g_cpu_current.load();
  out2[1] = g_cpu_peak.load();
  TZ_CATCH
}

int tz_cpu_reset_peak(char* err, size_t n) {
  TZ_TRY
  g_cpu_peak.store(g_cpu_current.load());
  TZ_CATCH
}

}  // extern "C"
