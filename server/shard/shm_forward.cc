#include "server/shard/shm_forward.h"

#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/common/auth.h"
#include "server/common/status.h"

namespace moe {
namespace {

// Whether [a, a + n) and [b, b + m) share a byte (both already inside one region, so no overflow).
bool Overlap(uint64_t a, uint64_t n, uint64_t b, uint64_t m) {
  return n > 0 && m > 0 && a < b + m && b < a + n;
}

// The hidden states travel outside the message (`where`): its own data field must be empty.
absl::Status RequireNoInlinePayload(const v1::ForwardRequest& request, absl::string_view where) {
  if (request.hidden_states().data().data().empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("request.hidden_states.data.data: must be empty (the bytes are in ", where, ")"));
}

// The output range the caller named must be exactly the output's size.
absl::Status CheckOutputSize(uint64_t range, size_t bytes) {
  if (range == bytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("output: range of ", range, " bytes, the output has ", bytes));
}

}  // namespace

ShmForwardService::ShmForwardService(ExpertShardService* shard, bool pin_regions,
                                     bool cuda_on_device)
    : shard_(shard),
      cuda_on_device_(cuda_on_device),
      registry_(ShmRegistry::Hooks{
          [backend = pin_regions ? shard->backend() : nullptr](void* base, uint64_t bytes) {
            if (backend == nullptr) return;
            if (absl::Status s = backend->RegisterHostMemory(base, static_cast<size_t>(bytes));
                !s.ok()) {
              LOG(WARNING) << "shared memory region of " << bytes
                           << " bytes not registered with the backend (its batches are staged "
                              "as usual): "
                           << s;
            }
          },
          [backend = pin_regions ? shard->backend() : nullptr](void* base) {
            if (backend != nullptr) backend->UnregisterHostMemory(base);
          }}) {}

grpc::Status ShmForwardService::RegisterSharedMemory(grpc::ServerContext*,
                                                     const v1::RegisterSharedMemoryRequest* req,
                                                     v1::RegisterSharedMemoryResponse*) {
  return ToGrpcStatus(registry_.Register(req->region_id(), req->shm_key(), req->byte_size()));
}

grpc::Status ShmForwardService::UnregisterSharedMemory(
    grpc::ServerContext*, const v1::UnregisterSharedMemoryRequest* req,
    v1::UnregisterSharedMemoryResponse*) {
  return ToGrpcStatus(registry_.Unregister(req->region_id()));
}

grpc::Status ShmForwardService::Forward(grpc::ServerContext* ctx,
                                        const v1::ShmForwardRequest* request,
                                        v1::ForwardResponse* response) {
  absl::StatusOr<AdmissionController::Ticket> ticket = shard_->AdmitCaller(CallerIdentity(*ctx));
  if (!ticket.ok()) return ToGrpcStatus(ticket.status());
  return ToGrpcStatus(DoForward(*request, response));
}

absl::Status ShmForwardService::DoForward(const v1::ShmForwardRequest& shm,
                                          v1::ForwardResponse* response) {
  if (absl::Status s = RequireNoInlinePayload(shm.request(), "shared memory"); !s.ok()) return s;
  const v1::SharedMemoryRef& in_ref = shm.hidden_states();
  const v1::SharedMemoryRef& out_ref = shm.output();
  absl::StatusOr<ShmRegistry::Lease> in_lease = registry_.Acquire(in_ref.region_id());
  if (!in_lease.ok()) return in_lease.status();
  absl::StatusOr<ShmRegistry::Lease> out_lease = registry_.Acquire(out_ref.region_id());
  if (!out_lease.ok()) return out_lease.status();
  absl::StatusOr<absl::Span<uint8_t>> in =
      in_lease->Range(in_ref.offset(), in_ref.length(), "hidden_states");
  if (!in.ok()) return in.status();
  absl::StatusOr<absl::Span<uint8_t>> out =
      out_lease->Range(out_ref.offset(), out_ref.length(), "output");
  if (!out.ok()) return out.status();
  if (in_ref.region_id() == out_ref.region_id() &&
      Overlap(in_ref.offset(), in_ref.length(), out_ref.offset(), out_ref.length())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "output: range [", out_ref.offset(), ", +", out_ref.length(),
        ") overlaps the hidden_states range [", in_ref.offset(), ", +", in_ref.length(), ")"));
  }
  // The hidden states are read in place and the output written in place: the shard's only
  // passes over the bytes are the conversions into and out of its F32 staging tensors.
  ForwardIo io;
  io.hidden_payload = absl::string_view(reinterpret_cast<const char*>(in->data()), in->size());
  io.output_buffer = [&](size_t bytes) -> absl::StatusOr<absl::Span<uint8_t>> {
    if (absl::Status s = CheckOutputSize(out->size(), bytes); !s.ok()) return s;
    return *out;
  };
  return shard_->ServeForward(shm.request(), response, io);
}

grpc::Status ShmForwardService::OpenChannel(grpc::ServerContext* ctx,
                                            const v1::OpenChannelRequest* request,
                                            v1::OpenChannelResponse* response) {
  if (request->offset() % alignof(ShmChannelBlock) != 0) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "offset: ", request->offset(), " is not ", alignof(ShmChannelBlock), "-byte aligned")));
  }
  absl::StatusOr<ShmRegistry::Lease> lease = registry_.Acquire(request->region_id());
  if (!lease.ok()) return ToGrpcStatus(lease.status());
  absl::StatusOr<absl::Span<uint8_t>> block =
      lease->Range(request->offset(), kShmChannelBlockBytes, "channel block");
  if (!block.ok()) return ToGrpcStatus(block.status());
  absl::MutexLock lock(&channels_mu_);
  if (channels_.size() >= kMaxChannels) {
    return ToGrpcStatus(absl::ResourceExhaustedError(
        absl::StrCat("the shard has ", kMaxChannels, " open channels; close one first")));
  }
  const std::string id = absl::StrCat("channel-", ++next_channel_);
  channels_[id] = std::make_unique<ShmChannelServer>(
      *std::move(lease), reinterpret_cast<ShmChannelBlock*>(block->data()),
      // Requests count against the quota of the client that opened the channel.
      [this, identity = CallerIdentity(*ctx)](const v1::ShmForwardRequest& req,
                                              v1::ForwardResponse* resp) -> absl::Status {
        absl::StatusOr<AdmissionController::Ticket> ticket = shard_->AdmitCaller(identity);
        if (!ticket.ok()) return ticket.status();
        return DoForward(req, resp);
      });
  response->set_channel_id(id);
  return grpc::Status::OK;
}

grpc::Status ShmForwardService::CloseChannel(grpc::ServerContext*,
                                             const v1::CloseChannelRequest* request,
                                             v1::CloseChannelResponse*) {
  std::unique_ptr<ShmChannelServer> channel;
  {
    absl::MutexLock lock(&channels_mu_);
    auto it = channels_.find(request->channel_id());
    if (it == channels_.end()) {
      return ToGrpcStatus(
          absl::NotFoundError(absl::StrCat("channel '", request->channel_id(), "' is not open")));
    }
    channel = std::move(it->second);
    channels_.erase(it);
  }
  channel.reset();  // joins the thread outside the lock (it may be finishing a request)
  return grpc::Status::OK;
}

grpc::Status ShmForwardService::ForwardCuda(grpc::ServerContext* ctx,
                                            const v1::CudaForwardRequest* request,
                                            v1::ForwardResponse* response) {
  absl::StatusOr<AdmissionController::Ticket> ticket = shard_->AdmitCaller(CallerIdentity(*ctx));
  if (!ticket.ok()) return ToGrpcStatus(ticket.status());
  return ToGrpcStatus(DoForwardCuda(*request, response));
}

absl::Status ShmForwardService::ServeOnDevice(const v1::CudaForwardRequest& cuda,
                                              const CudaIpcMemory::Borrowed& in,
                                              const CudaIpcMemory::Borrowed& out,
                                              v1::ForwardResponse* response) {
  const uint64_t out_length = cuda.output().length();
  ForwardIo io;
  io.device = true;
  io.hidden_payload = absl::string_view(in.data(), cuda.hidden_states().length());
  io.output_buffer = [&](size_t bytes) -> absl::StatusOr<absl::Span<uint8_t>> {
    if (absl::Status s = CheckOutputSize(out_length, bytes); !s.ok()) return s;
    return absl::Span<uint8_t>(reinterpret_cast<uint8_t*>(out.data()), bytes);
  };
  io.zero_device = [this](absl::Span<uint8_t> bytes) {
    return cuda_ipc_.ZeroDevice(bytes.data(), bytes.size());
  };
  return shard_->ServeForward(cuda.request(), response, io);
}

absl::Status ShmForwardService::DoForwardCuda(const v1::CudaForwardRequest& cuda,
                                              v1::ForwardResponse* response) {
  if (absl::Status s = RequireNoInlinePayload(cuda.request(), "device memory"); !s.ok()) return s;
  const v1::CudaIpcRef& in_ref = cuda.hidden_states();
  const v1::CudaIpcRef& out_ref = cuda.output();
  for (const auto& [ref, field] :
       {std::pair{&in_ref, "hidden_states"}, std::pair{&out_ref, "output"}}) {
    if (ref->length() > kMaxCudaIpcBytes) {
      return absl::ResourceExhaustedError(absl::StrCat(field, ": length ", ref->length(),
                                                       " exceeds the ", kMaxCudaIpcBytes,
                                                       "-byte limit of one ForwardCuda"));
    }
  }
  // A backend on the device the handles open on (a CUDA backend) takes the frontend's device
  // memory as it is: hidden states and output never leave the GPU. Other formats than F32 and
  // BF16 need the host's decoding: staged.
  const v1::ActivationFormat format = cuda.request().hidden_states().format();
  if (cuda_on_device_ && shard_->backend() != nullptr &&
      shard_->backend()->DeviceForTensors() == CudaIpcMemory::kDevice &&
      (format == v1::ACTIVATION_BF16 || format == v1::ACTIVATION_F32)) {
    absl::StatusOr<CudaIpcMemory::Borrowed> in = cuda_ipc_.Borrow(
        in_ref.handle(), in_ref.offset(), in_ref.length(), "hidden_states");
    if (!in.ok()) return in.status();
    absl::StatusOr<CudaIpcMemory::Borrowed> out =
        cuda_ipc_.Borrow(out_ref.handle(), out_ref.offset(), out_ref.length(), "output");
    if (!out.ok()) return out.status();
    // Hidden states at an address their type may not be read from (an odd offset) take the
    // staged path below, which realigns them.
    const size_t align = format == v1::ACTIVATION_F32 ? 4 : 2;
    if (reinterpret_cast<uintptr_t>(in->data()) % align == 0) {
      return ServeOnDevice(cuda, *in, *out, response);
    }
  }
  if (absl::Status s = cuda_ipc_.Check(out_ref.handle(), out_ref.offset(), out_ref.length(),
                                       "output");
      !s.ok()) {
    return s;
  }
  HostTensor host_in =
      HostTensor::Uninitialized(DType::kU8, {static_cast<int64_t>(in_ref.length())});
  if (absl::Status s = cuda_ipc_.CopyToHost(in_ref.handle(), in_ref.offset(), in_ref.length(),
                                            host_in.data<uint8_t>(), "hidden_states");
      !s.ok()) {
    return s;
  }
  HostTensor host_out;
  ForwardIo io;
  io.hidden_payload =
      absl::string_view(reinterpret_cast<const char*>(host_in.data<uint8_t>()), in_ref.length());
  io.output_buffer = [&](size_t bytes) -> absl::StatusOr<absl::Span<uint8_t>> {
    if (absl::Status s = CheckOutputSize(out_ref.length(), bytes); !s.ok()) return s;
    host_out = HostTensor::Uninitialized(DType::kU8, {static_cast<int64_t>(bytes)});
    return absl::Span<uint8_t>(host_out.data<uint8_t>(), bytes);
  };
  if (absl::Status s = shard_->ServeForward(cuda.request(), response, io); !s.ok()) return s;
  return cuda_ipc_.CopyFromHost(host_out.data<uint8_t>(), out_ref.handle(), out_ref.offset(),
                                out_ref.length(), "output");
}

void ShmForwardService::CloseAllChannels() {
  std::map<std::string, std::unique_ptr<ShmChannelServer>> channels;
  {
    absl::MutexLock lock(&channels_mu_);
    channels.swap(channels_);
  }
}

}  // namespace moe
