// A stand-in "npu" device for the tests: torch's PrivateUse1 backend, on host memory, strict where a device is.
//
// Memory: one allocator per visible device, counting current and peak bytes against a fixed capacity (so
// mem_get_info and max_memory_allocated mean something). Devices: MOSS_NPU_STANDIN_DEVICES physical ones
// (default 2), of which ASCEND_RT_VISIBLE_DEVICES picks the visible ones, as CANN does. Kernels: every op without
// an explicit kernel here reaches one boxed fallback that runs torch's CPU kernel on host views of the device
// memory (nothing is copied), after refusing what a device refuses: a CPU tensor that is not a 0-dim scalar mixed
// with device tensors, two device indexes in one op, a CPU generator for a device op. Random ops draw from the
// device's own generator. It counts every op it dispatched, device->host and host->device copies and .item().
// Graphs: between capture_begin and capture_end every op is recorded and leaves no trace (what it wrote into older
// memory is put back, the capture's own memory is left holding 0xFF bytes: NaN in floats, -1 in integers), and a
// host sync raises; replay runs the recorded calls in order.
#include <torch/extension.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/NativeFunctions.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;

constexpr DeviceType kNpu = DeviceType::PrivateUse1;

// ---- devices --------------------------------------------------------------------------------------------------

std::vector<int> parse_visible() {
  int physical = 2;
  if (const char* n = std::getenv("MOSS_NPU_STANDIN_DEVICES")) physical = std::atoi(n);
  std::vector<int> ids;
  const char* visible = std::getenv("ASCEND_RT_VISIBLE_DEVICES");
  if (visible == nullptr) {
    for (int i = 0; i < physical; ++i) ids.push_back(i);
    return ids;
  }
  std::stringstream list(visible);
  std::string item;
  while (std::getline(list, item, ',')) {
    const int id = std::atoi(item.c_str());
    TORCH_CHECK(!item.empty() && id >= 0 && id < physical, "ASCEND_RT_VISIBLE_DEVICES=", visible,
                ": device ", item, " does not exist (", physical, " devices)");
    ids.push_back(id);
  }
  return ids;
}

const std::vector<int>& visible() {
  static const std::vector<int> ids = parse_visible();
  return ids;
}

DeviceIndex device_count() { return static_cast<DeviceIndex>(visible().size()); }

thread_local DeviceIndex current_device = 0;

DeviceIndex checked(DeviceIndex index) {
  if (index < 0) return current_device;
  TORCH_CHECK(index < device_count(), "npu:", int(index), " is not a visible device (", int(device_count()),
              " visible)");
  return index;
}

// MOSS_NPU_STANDIN_BREAK=KIND:N raises at the N-th copy of KIND (host_to_device, device_to_host): the traceback
// shows which line of a program moved data across (a debugging aid; the tests do not set it).
void break_at(const char* kind, int64_t n) {
  static const std::string spec = [] {
    const char* v = std::getenv("MOSS_NPU_STANDIN_BREAK");
    return std::string(v ? v : "");
  }();
  const std::string prefix = std::string(kind) + ":";
  TORCH_CHECK(spec.rfind(prefix, 0) != 0 || std::atoll(spec.c_str() + prefix.size()) != n,
              "MOSS_NPU_STANDIN_BREAK: ", kind, " copy number ", n);
}

// ---- graphs (state) ------------------------------------------------------------------------------------------

struct Graph;
std::atomic<Graph*> capturing{nullptr};  // the graph being captured (one at a time per process, as on a device)
std::atomic<std::thread::id> capturing_thread;
thread_local bool replaying = false;
std::mutex capture_lock;
std::unordered_map<void*, size_t> capture_blocks;  // memory allocated while capturing (a graph's pool) -> bytes

std::atomic<bool> capture_global{true};  // capture_error_mode "global": a sync from any thread breaks the capture

bool is_capturing() { return capturing != nullptr && std::this_thread::get_id() == capturing_thread; }

int sync_debug_mode = 0;  // torch_npu's set_sync_debug_mode: 0 default, 1 warn, 2 error on each host sync

void refuse_sync_in_capture(const char* what) {
  if (sync_debug_mode == 1) TORCH_WARN("called a synchronizing NPU operation: ", what);
  TORCH_CHECK(sync_debug_mode != 2, "called a synchronizing NPU operation: ", what);
  TORCH_CHECK(!is_capturing(), what, ": a host synchronization while capturing a graph (operation not permitted "
              "when stream is capturing)");
  TORCH_CHECK(capturing == nullptr || !capture_global, what, ": a host synchronization in another thread while a "
              "graph is captured with capture_error_mode=\"global\" (operation not permitted when stream is capturing)");
}

// ---- memory ---------------------------------------------------------------------------------------------------

constexpr size_t kHeader = 64;  // each block's bookkeeping, before its data (which stays 64-byte aligned)

struct Usage {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
};

int64_t capacity() {
  static const int64_t bytes = [] {
    const char* gib = std::getenv("MOSS_NPU_STANDIN_MEMORY_GIB");
    return static_cast<int64_t>((gib ? std::atof(gib) : 16.0) * (1LL << 30));
  }();
  return bytes;
}

Usage& usage(DeviceIndex index) {
  static std::vector<std::unique_ptr<Usage>> all = [] {
    std::vector<std::unique_ptr<Usage>> v;
    for (DeviceIndex i = 0; i < device_count(); ++i) v.push_back(std::make_unique<Usage>());
    return v;
  }();
  return *all.at(checked(index));
}

struct Block {
  int64_t bytes;
  DeviceIndex device;
};

void free_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  usage(block->device).current -= block->bytes;
  {
    std::lock_guard<std::mutex> guard(capture_lock);
    capture_blocks.erase(static_cast<char*>(ctx) + kHeader);
  }
  std::free(ctx);  // the block header and its data are one allocation
}

struct Allocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    const DeviceIndex index = checked(current_device);
    Usage& u = usage(index);
    TORCH_CHECK_WITH(OutOfMemoryError, u.current + static_cast<int64_t>(n) <= capacity(),
                     "NPU out of memory: tried to allocate ", n, " bytes on npu:", int(index), " (",
                     u.current.load(), " of ", capacity(), " in use)");
    void* raw = std::aligned_alloc(kHeader, kHeader + ((n + kHeader - 1) / kHeader) * kHeader);
    TORCH_CHECK(raw != nullptr, "host allocation of ", n, " bytes failed");
    auto* block = new (raw) Block{static_cast<int64_t>(n), index};
    const int64_t now = (u.current += static_cast<int64_t>(n));
    int64_t peak = u.peak.load();
    while (now > peak && !u.peak.compare_exchange_weak(peak, now)) {
    }
    if (is_capturing()) {  // the graph's pool: memory the capturing thread takes (other threads run as usual)
      std::lock_guard<std::mutex> guard(capture_lock);
      capture_blocks[static_cast<char*>(raw) + kHeader] = n;
    }
    return {static_cast<char*>(raw) + kHeader, block, &free_block, Device(kNpu, index)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }
};

Allocator allocator;
REGISTER_ALLOCATOR(kNpu, &allocator);

// ---- device guard, generators, hooks ---------------------------------------------------------------------------

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return kNpu; }
  Device exchangeDevice(Device d) const override {
    const Device old = getDevice();
    setDevice(d);
    return old;
  }
  Device getDevice() const override { return Device(kNpu, current_device); }
  void setDevice(Device d) const override { current_device = checked(d.index()); }
  void uncheckedSetDevice(Device d) const noexcept override {
    if (d.index() >= 0) current_device = d.index();
  }
  c10::Stream getStream(Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const override { return c10::Stream(c10::Stream::DEFAULT, s.device()); }
  DeviceIndex deviceCount() const noexcept override { return device_count(); }
  void record(void**, const c10::Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  void synchronizeDevice(const DeviceIndex) const override {}
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

struct Generator final : at::CPUGeneratorImpl {
  explicit Generator(DeviceIndex index) {
    device_ = Device(kNpu, index);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
  static DeviceType device_type() { return kNpu; }
};

const at::Generator& default_generator(DeviceIndex index) {
  static std::vector<at::Generator> all = [] {
    std::vector<at::Generator> v;
    for (DeviceIndex i = 0; i < device_count(); ++i) v.push_back(at::make_generator<Generator>(i));
    return v;
  }();
  return all.at(checked(index));
}

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(DeviceIndex d) const override { current_device = checked(d); }
  DeviceIndex getCurrentDevice() const override { return current_device; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    const DeviceIndex old = current_device;
    current_device = checked(d);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(DeviceIndex d) const override { return default_generator(d); }
  at::Generator getNewGenerator(DeviceIndex d) const override { return at::make_generator<Generator>(checked(d)); }
};

const bool hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

// ---- counters -------------------------------------------------------------------------------------------------

struct Counters {
  std::mutex lock;
  std::map<std::string, int64_t> ops;  // every op dispatched eagerly, by name (overload included)
  int64_t device_to_host = 0, host_to_device = 0, items = 0, replays = 0;
};

Counters counters;

void count_op(const c10::OperatorName& name) {
  std::lock_guard<std::mutex> guard(counters.lock);
  ++counters.ops[name.overload_name.empty() ? name.name : name.name + "." + name.overload_name];
}

void count(int64_t Counters::*field) {
  std::lock_guard<std::mutex> guard(counters.lock);
  ++(counters.*field);
}

// ---- host views of device memory --------------------------------------------------------------------------------

at::Tensor host_view(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kNpu) return t;
  if (t.numel() == 0 || t.data_ptr() == nullptr) return at::empty(t.sizes(), t.options().device(at::kCPU));
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

at::Tensor npu_empty_like_host(const at::Tensor& h, DeviceIndex index) {
  c10::DeviceGuard guard(Device(kNpu, index));
  const c10::DispatchKeySet keys(c10::DispatchKey::PrivateUse1);
  if (h.is_non_overlapping_and_dense()) {
    return at::detail::empty_strided_generic(h.sizes(), h.strides(), &allocator, keys, h.scalar_type());
  }
  return at::detail::empty_generic(h.sizes(), &allocator, keys, h.scalar_type(), std::nullopt);
}

// One op's device arguments and the host views given to the CPU kernel in their place.
struct Call {
  DeviceIndex index = -1;
  std::vector<std::pair<at::Tensor, at::Tensor>> tensors;  // (device tensor, its host view)
  std::vector<std::pair<at::Generator, at::Generator>> generators;  // (device generator, host stand-in)
  std::vector<std::unique_lock<std::mutex>> generator_locks;  // held for the whole op, as a CPU kernel holds its own
};

void check_device(Call& call, const at::Tensor& t, const c10::OperatorName& name) {
  if (!t.defined()) return;
  if (t.device().type() == kNpu) {
    TORCH_CHECK(call.index < 0 || call.index == t.device().index(), "Expected all tensors to be on the same device, "
                "but found at least two devices, npu:", int(call.index), " and npu:", int(t.device().index()),
                "! (", name.name, ")");
    call.index = t.device().index();
  } else {
    TORCH_CHECK(t.dim() == 0, "Expected all tensors to be on the same device, but found at least two devices, npu "
                "and ", t.device().str(), "! (", name.name, ": a ", t.dim(), "-dim ", t.device().str(),
                " tensor; only 0-dim CPU tensors may mix with npu tensors)");
  }
}

template <typename F>
void each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isList()) {
    for (const c10::IValue& item : v.toListRef()) {
      if (item.isTensor()) f(item.toTensor());
    }
  }
}

c10::IValue to_host(Call& call, const c10::IValue& v) {
  auto view = [&](const at::Tensor& t) {
    at::Tensor h = host_view(t);
    if (t.defined() && t.device().type() == kNpu) call.tensors.emplace_back(t, h);
    return h;
  };
  if (v.isTensor()) return view(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(view(t));
    return out;
  }
  if (v.isList() && v.toList().elementType()->kind() == c10::TypeKind::OptionalType) {
    c10::List<std::optional<at::Tensor>> out;
    for (const c10::IValue& item : v.toListRef()) {
      out.push_back(item.isTensor() ? std::optional<at::Tensor>(view(item.toTensor())) : std::nullopt);
    }
    return out;
  }
  if (v.isDevice() && v.toDevice().type() == kNpu) return c10::IValue(Device(at::kCPU));
  return v;
}

at::Generator host_generator(Call& call, at::Generator device_gen) {
  TORCH_CHECK(device_gen.device().type() == kNpu, "Expected a 'npu' device type for generator but found '",
              device_gen.device().str(), "'");
  TORCH_CHECK(call.index < 0 || device_gen.device().index() == call.index, "generator on ", device_gen.device().str(),
              " given to an op on npu:", int(call.index));
  at::Generator host = at::make_generator<at::CPUGeneratorImpl>();
  call.generator_locks.emplace_back(device_gen.mutex());
  host.set_state(device_gen.get_state());
  call.generators.emplace_back(device_gen, host);
  return host;
}

// The device tensor for a CPU kernel's output: the argument itself (in place, out=), a view of an argument's memory,
// or a new device tensor holding a copy of a new host result.
at::Tensor to_device(const Call& call, const at::Tensor& out) {
  if (!out.defined() || out.device().type() != at::kCPU) return out;
  for (const auto& [device, host] : call.tensors) {
    if (out.unsafeGetTensorImpl() == host.unsafeGetTensorImpl()) return device;
  }
  const char* p = static_cast<const char*>(out.data_ptr());
  for (const auto& [device, host] : call.tensors) {
    const char* base = static_cast<const char*>(device.storage().data());
    if (p != nullptr && base != nullptr && p >= base && p < base + device.storage().nbytes()) {
      const int64_t offset = (p - base) / static_cast<int64_t>(out.element_size());
      return at::empty({0}, device.options().dtype(out.scalar_type()))
          .set_(device.storage(), offset, out.sizes(), out.strides());
    }
  }
  at::Tensor result = npu_empty_like_host(out, call.index < 0 ? current_device : call.index);
  host_view(result).copy_(out);
  return result;
}

struct Recorded {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;
  std::vector<c10::IValue> outputs;  // the device results the capture returned; a replay writes new results there
};

struct Graph {
  std::vector<Recorded> calls;
  std::vector<std::pair<at::Tensor, at::Tensor>> saved;  // (tensor made before the capture, contents before a write)
  bool captured = false;
};

// While capturing, ops run (later ops need real shapes and valid indexes) but leave no trace: what they write into
// memory made before the capture is kept here and put back at capture_end, and the memory made during the capture
// is then filled with 0xFF bytes (NaN in floats, -1 in integers), as a capture leaves it unwritten.
void keep_before_write(const at::Tensor& t) {
  if (!is_capturing() || !t.defined() || t.device().type() != kNpu || t.numel() == 0) return;
  {
    std::lock_guard<std::mutex> guard(capture_lock);
    if (capture_blocks.count(t.storage().mutable_data())) return;
  }
  capturing.load()->saved.emplace_back(t, host_view(t).clone());
}

void end_capture(Graph& g) {
  for (auto it = g.saved.rbegin(); it != g.saved.rend(); ++it) host_view(it->first).copy_(it->second);
  g.saved.clear();
  std::lock_guard<std::mutex> guard(capture_lock);
  for (auto& [ptr, bytes] : capture_blocks) std::memset(ptr, 0xFF, bytes);
  capture_blocks.clear();
}

bool is_random(const c10::FunctionSchema& schema) {
  for (const auto& a : schema.arguments()) {
    if (a.type()->str().find("Generator") != std::string::npos) return true;
  }
  return false;
}

// Run ``op`` on the CPU kernel over host views of ``stack``'s device tensors; leave device results on the stack.
void run(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool recording) {
  const auto& schema = op.schema();
  const auto& name = schema.operator_name();
  const size_t n_args = schema.arguments().size();
  Call call;
  for (const c10::IValue& v : torch::jit::last(stack, n_args)) each_tensor(v, [&](const at::Tensor& t) {
    check_device(call, t, name);
  });
  for (const c10::IValue& v : torch::jit::last(stack, n_args)) {
    if (v.isDevice() && v.toDevice().type() == kNpu && call.index < 0) call.index = checked(v.toDevice().index());
  }
  torch::jit::Stack host;
  std::vector<std::pair<at::Tensor, at::Tensor>> written;  // (device tensor, host view) of the arguments written
  for (size_t i = 0; i < n_args; ++i) {
    const c10::IValue& v = (*stack)[stack->size() - n_args + i];
    const auto& argument = schema.arguments()[i];
    if (v.isGenerator()) {
      host.push_back(host_generator(call, v.toGenerator()));
    } else if (v.isNone() && argument.type()->str().find("Generator") != std::string::npos) {
      host.push_back(host_generator(call, default_generator(call.index < 0 ? current_device : call.index)));
    } else {
      const size_t first = call.tensors.size();
      host.push_back(to_host(call, v));
      if (argument.alias_info() != nullptr && argument.alias_info()->isWrite()) {
        for (size_t j = first; j < call.tensors.size(); ++j) written.push_back(call.tensors[j]);
      }
    }
    if (recording && argument.alias_info() != nullptr && argument.alias_info()->isWrite()) {
      each_tensor(v, keep_before_write);
    }
  }
  torch::jit::drop(stack, n_args);
  c10::DeviceGuard guard(Device(kNpu, call.index < 0 ? current_device : call.index));
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &host);
  for (auto& [device, h] : written) {  // an out= argument the kernel resized (its host view was replaced)
    if (h.sizes() != device.sizes() || h.data_ptr() != device.data_ptr()) {
      device.resize_(h.sizes());
      host_view(device).copy_(h);
    }
  }
  for (auto& [device_gen, host_gen] : call.generators) {
    if (recording) continue;  // a capture draws nothing: the generator keeps its state
    device_gen.set_state(host_gen.get_state());
  }
  for (c10::IValue& v : host) {
    if (v.isTensor()) {
      stack->push_back(to_device(call, v.toTensor()));
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) out.push_back(to_device(call, t));
      stack->push_back(out);
    } else {
      stack->push_back(v);
    }
  }
}

const std::vector<std::string> kDataDependent = {"aten::nonzero", "aten::masked_select", "aten::_unique2",
                                                 "aten::unique_consecutive", "aten::equal", "aten::is_nonzero"};

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& name = op.schema().operator_name();
  for (const auto& sync : kDataDependent) {
    if (name.name == sync) {
      refuse_sync_in_capture(sync.c_str());
      count(&Counters::device_to_host);  // the result's size (or value) is read back by the host
    }
  }
  if (!replaying) count_op(name);
  if (!is_capturing()) {
    run(op, stack, false);
    return;
  }
  const size_t n_args = op.schema().arguments().size();
  std::vector<c10::IValue> args(stack->end() - n_args, stack->end());
  run(op, stack, true);
  std::vector<c10::IValue> outputs(stack->end() - op.schema().returns().size(), stack->end());
  capturing.load()->calls.push_back({op, std::move(args), std::move(outputs)});
}

void replay(Graph& graph) {
  TORCH_CHECK(graph.captured, "replay of a graph that was not captured");
  count(&Counters::replays);
  replaying = true;
  try {
    for (Recorded& call : graph.calls) {
      torch::jit::Stack stack(call.args.begin(), call.args.end());
      run(call.op, &stack, false);
      for (size_t i = 0; i < call.outputs.size(); ++i) {
        const c10::IValue& kept = call.outputs[i];
        const c10::IValue& fresh = stack[i];
        auto copy = [](const at::Tensor& dst, const at::Tensor& src) {
          if (dst.defined() && dst.unsafeGetTensorImpl() != src.unsafeGetTensorImpl() &&
              dst.storage().data() != src.storage().data()) {
            host_view(dst).copy_(host_view(src));
          }
        };
        if (kept.isTensor()) copy(kept.toTensor(), fresh.toTensor());
        if (kept.isTensorList()) {
          auto a = kept.toTensorList(), b = fresh.toTensorList();
          for (size_t j = 0; j < a.size(); ++j) copy(a[j], b[j]);
        }
      }
    }
  } catch (...) {
    replaying = false;
    throw;
  }
  replaying = false;
}

// ---- explicit kernels: memory, views, copies ---------------------------------------------------------------------

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<Device> device,
                               std::optional<bool> pin_memory, std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(Device(kNpu, checked(c10::device_or_default(device).index())));
  return at::detail::empty_generic(size, &allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<Device> device,
                         std::optional<bool> pin_memory) {
  c10::DeviceGuard guard(Device(kNpu, checked(c10::device_or_default(device).index())));
  return at::detail::empty_strided_generic(size, stride, &allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> storage_offset) {
  return at::cpu::as_strided_symint(self, size, stride, storage_offset);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

at::Tensor& set_storage(at::Tensor& self, at::Storage storage, int64_t offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  return at::cpu::set_(self, storage, offset, size, stride);
}

at::Tensor& set_source(at::Tensor& self, const at::Tensor& source) { return at::native::set_tensor_(self, source); }

// _copy_from(self=src, dst): every copy that involves the device. Host<->device copies are counted (and refused
// while capturing: the host would wait); device->device copies are recorded in a capture like any op.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const bool from_npu = self.device().type() == kNpu, to_npu = dst.device().type() == kNpu;
  if (from_npu && to_npu) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
    if (!replaying) count_op(op.schema().operator_name());
    if (is_capturing()) {
      keep_before_write(dst);
      capturing.load()->calls.push_back({op, {dst, self, false}, {dst}});
    }
    host_view(dst).copy_(host_view(self));
    return dst;
  }
  refuse_sync_in_capture(from_npu ? "a device->host copy" : "a host->device copy");
  count(from_npu ? &Counters::device_to_host : &Counters::host_to_device);
  break_at(from_npu ? "device_to_host" : "host_to_device", from_npu ? counters.device_to_host : counters.host_to_device);
  host_view(dst).copy_(host_view(self), non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

c10::Scalar local_scalar_dense(const at::Tensor& self) {
  refuse_sync_in_capture(".item()");
  count(&Counters::items);
  return at::native::_local_scalar_dense_cpu(host_view(self));
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Tensor", set_source);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  // torch sends convolutions on other backends to convolution_overrideable, which raises: run torch's own
  m.impl("convolution", torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("device_count", [] { return int(device_count()); });
  m.def("current_device", [] { return int(current_device); });
  m.def("set_device", [](int index) { current_device = checked(index); });
  m.def("memory", [](int index) {
    Usage& u = usage(index);
    return std::make_tuple(u.current.load(), u.peak.load(), capacity());
  });
  m.def("reset_peak", [](int index) {
    Usage& u = usage(index);
    u.peak = u.current.load();
  });
  m.def("synchronize", [] {
    const int mode = sync_debug_mode;
    sync_debug_mode = 0;  // an explicit synchronize is not reported, as in torch
    try {
      refuse_sync_in_capture("synchronize");
    } catch (...) {
      sync_debug_mode = mode;
      throw;
    }
    sync_debug_mode = mode;
  });
  m.def("get_sync_debug_mode", [] { return sync_debug_mode; });
  m.def("set_sync_debug_mode", [](int mode) { sync_debug_mode = mode; });
  m.def("counters", [] {
    std::lock_guard<std::mutex> guard(counters.lock);
    py::dict ops;
    for (const auto& [name, n] : counters.ops) ops[py::str(name)] = n;
    py::dict out;
    out["ops"] = ops;
    out["device_to_host"] = counters.device_to_host;
    out["host_to_device"] = counters.host_to_device;
    out["items"] = counters.items;
    out["replays"] = counters.replays;
    return out;
  });
  m.def("reset_counters", [] {
    std::lock_guard<std::mutex> guard(counters.lock);
    counters.ops.clear();
    counters.device_to_host = counters.host_to_device = counters.items = counters.replays = 0;
  });
  m.def("default_generator", [](int index) { return default_generator(index); });
  py::class_<Graph, std::shared_ptr<Graph>>(m, "Graph")
      .def(py::init<>())
      .def("capture_begin", [](Graph& g, const std::string& mode) {
        TORCH_CHECK(capturing == nullptr, "another graph is being captured");
        TORCH_CHECK(mode == "global" || mode == "thread_local" || mode == "relaxed", "capture_error_mode ", mode,
                    ": use global, thread_local or relaxed");
        capture_global = mode == "global";
        g.calls.clear();
        g.captured = false;
        capturing_thread = std::this_thread::get_id();  // before the graph: another thread reads them in that order
        capturing = &g;
      })
      .def("capture_end", [](Graph& g) {
        TORCH_CHECK(capturing == &g, "capture_end without capture_begin");
        end_capture(g);
        capturing = nullptr;
        g.captured = true;
      })
      .def("abort", [](Graph& g) {
        if (capturing == &g) {
          end_capture(g);
          capturing = nullptr;
        }
      })
      .def("replay", [](Graph& g) { replay(g); })
      .def("reset", [](Graph& g) {
        g.calls.clear();
        g.captured = false;
      })
      .def("__len__", [](Graph& g) { return g.calls.size(); });
  m.def("is_capturing", [] { return capturing != nullptr; });
}
