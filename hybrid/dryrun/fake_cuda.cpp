// Fake CUDA for the dry run on a CPU-only torch (hybrid/dryrun/fake_cuda.py): a no-op CUDA device
// guard and CUDA hooks that report devices, so that fake tensors on cuda:N can be copied,
// sliced and back-propagated. No memory is ever allocated on a device: every tensor the dry run
// creates is a FakeTensor. Loaded before torch (its hooks are read once, at torch's import).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
thread_local c10::DeviceIndex current_index = 0;
constexpr c10::DeviceIndex kDevices = 64;

struct NoOpCudaGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old(c10::DeviceType::CUDA, current_index);
    if (d.has_index()) current_index = d.index();
    return old;
  }
  c10::Device getDevice() const override {
    return c10::Device(c10::DeviceType::CUDA, current_index);
  }
  void setDevice(c10::Device d) const override {
    if (d.has_index()) current_index = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index()) current_index = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return kDevices; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};
C10_REGISTER_GUARD_IMPL(CUDA, NoOpCudaGuard);

struct FakeCudaHooks final : public at::CUDAHooksInterface {
  explicit FakeCudaHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return kDevices; }
  int getNumGPUs() const override { return kDevices; }
  c10::DeviceIndex current_device() const override { return current_index; }
  c10::DeviceIndex getCurrentDevice() const override { return current_index; }
  void setCurrentDevice(c10::DeviceIndex d) const override { current_index = d; }
  void deviceSynchronize(c10::DeviceIndex) const override {}
};
}  // namespace

namespace at {
// the name torch looks up (at::detail::getCUDAHooks creates "CUDAHooks")
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", FakeCudaHooks);
}  // namespace at
