// MTLIOCommandQueue read backend (Apple + Metal builds only; see io_mtlio.h).
//
// UNVERIFIED: only type-checked (clang -fsyntax-only) against Apple's
// metal-cpp headers (macOS 14, 15 and 26 releases) on Linux, with the Apple
// system headers stubbed; never linked or run. The engine never selects it
// on its own (EngineOptions::backend defaults to "pread").
//
// This is the only TU of the extension that includes metal-cpp, so it owns
// the private selector/class definitions; hidden so they do not clash with
// libmlx's own copy.
#define METALCPP_SYMBOL_VISIBILITY_HIDDEN
#define NS_PRIVATE_IMPLEMENTATION
#define MTL_PRIVATE_IMPLEMENTATION
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>

#include "io_mtlio.h"

#include <mutex>
#include <unordered_map>

namespace hebrus {

namespace {

// Worker threads are plain std::threads without an autorelease pool; every
// autoreleased object (command buffers, NSErrors, URLs) must die in one.
class PoolScope {
 public:
  PoolScope() : pool_(NS::AutoreleasePool::alloc()->init()) {}
  ~PoolScope() {
    pool_->release();
  }
  PoolScope(const PoolScope&) = delete;
  PoolScope& operator=(const PoolScope&) = delete;

 private:
  NS::AutoreleasePool* pool_;
};

std::string describe(NS::Error* err) {
  if (err == nullptr) {
    return "no error description";
  }
  NS::String* s = err->localizedDescription();
  const char* text = s ? s->utf8String() : nullptr;
  return text ? text : "no error description";
}

} // namespace

struct MtlioReader::Impl {
  MTL::Device* device = nullptr;
  // MTLIO priority is a queue property: [0] high for P0 (exact), [1]
  // normal for P1/P2. The engine already orders work across classes; the
  // device priority only matters between commands in flight together.
  MTL::IOCommandQueue* queues[2] = {nullptr, nullptr};
  std::mutex mu;
  // One handle per store, opened on first use; stores are append-only in
  // the engine, so a store id never changes meaning.
  std::unordered_map<int, MTL::IOFileHandle*> handles;

  ~Impl() {
    for (auto& [store, h] : handles) {
      h->release();
    }
    for (auto* q : queues) {
      if (q) {
        q->release();
      }
    }
    if (device) {
      device->release();
    }
  }
};

MtlioReader::MtlioReader(int max_in_flight) : impl_(std::make_unique<Impl>()) {
  PoolScope pool;
  // load() opens files with newIOFileHandleWithURL:error:, which macOS 13
  // lacks (it had newIOHandleWithURL:); there the message would raise an
  // uncaught Objective-C exception in a worker, so refuse up front.
  if (!NS::ProcessInfo::processInfo()->isOperatingSystemAtLeastVersion(
          NS::OperatingSystemVersion{14, 0, 0})) {
    throw StreamError(
        ErrorCode::kBadRequest, "backend: 'mtlio' needs macOS 14 or later");
  }
  impl_->device = MTL::CreateSystemDefaultDevice();
  if (impl_->device == nullptr) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "backend: 'mtlio' needs a Metal device and this machine has none");
  }
  for (int i = 0; i < 2; ++i) {
    MTL::IOCommandQueueDescriptor* desc =
        MTL::IOCommandQueueDescriptor::alloc()->init();
    desc->setType(MTL::IOCommandQueueTypeConcurrent);
    desc->setPriority(i == 0 ? MTL::IOPriorityHigh : MTL::IOPriorityNormal);
    desc->setMaxCommandsInFlight(static_cast<NS::UInteger>(max_in_flight));
    NS::Error* err = nullptr;
    impl_->queues[i] = impl_->device->newIOCommandQueue(desc, &err);
    desc->release();
    if (impl_->queues[i] == nullptr) {
      throw StreamError(
          ErrorCode::kBadRequest,
          "backend: 'mtlio' could not create an MTLIOCommandQueue: " +
              describe(err));
    }
  }
}

MtlioReader::~MtlioReader() = default;

ErrorCode MtlioReader::load(
    int store, const std::string& path, uint64_t file_offset,
    const std::vector<IoTarget>& targets, bool urgent, std::string& msg) {
  PoolScope pool;
  MTL::IOFileHandle* handle = nullptr;
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    auto it = impl_->handles.find(store);
    if (it != impl_->handles.end()) {
      handle = it->second;
    }
  }
  if (handle == nullptr) {
    NS::Error* err = nullptr;
    NS::URL* url = NS::URL::fileURLWithPath(
        NS::String::string(path.c_str(), NS::UTF8StringEncoding));
    MTL::IOFileHandle* opened = impl_->device->newIOFileHandle(url, &err);
    if (opened == nullptr) {
      msg = "MTLIO could not open " + path + ": " + describe(err);
      return ErrorCode::kIO;
    }
    std::lock_guard<std::mutex> lk(impl_->mu);
    auto [it, inserted] = impl_->handles.emplace(store, opened);
    if (!inserted) {
      opened->release(); // another worker opened it first
    }
    handle = it->second;
  }
  MTL::IOCommandBuffer* cmd = impl_->queues[urgent ? 0 : 1]->commandBuffer();
  if (cmd == nullptr) {
    msg = "MTLIO could not create a command buffer";
    return ErrorCode::kIO;
  }
  uint64_t src = file_offset;
  for (const IoTarget& t : targets) {
    cmd->loadBuffer(
        static_cast<const MTL::Buffer*>(t.buffer),
        static_cast<NS::UInteger>(t.offset),
        static_cast<NS::UInteger>(t.length),
        handle,
        static_cast<NS::UInteger>(src));
    src += t.length;
  }
  cmd->commit();
  cmd->waitUntilCompleted();
  switch (cmd->status()) {
    case MTL::IOStatusComplete:
      return ErrorCode::kNone;
    case MTL::IOStatusCancelled:
      msg = "MTLIO command buffer cancelled: " + describe(cmd->error());
      return ErrorCode::kIO;
    default:
      msg = "MTLIO load failed: " + describe(cmd->error());
      return ErrorCode::kIO;
  }
}

} // namespace hebrus
