# The envelope of every distgrad RPC frame (see docs/wire_protocol.md).
#
# A frame is a 24-byte prefix, the payload sizes, this envelope (a single Cap'n Proto message) and N raw
# payload buffers. Tensor bytes never live in the envelope: a TensorDesc names its payload by index.
#
# Evolution rules (Cap'n Proto's, which keep old and new peers compatible):
#   - never renumber, retype or remove a field; add new fields with the next ordinal (@N) at the end;
#   - new union members get new ordinals too; a reader meeting an unknown union member or enumerant
#     rejects that message with an error (it never guesses);
#   - a change old peers cannot ignore bumps transport::kProtocolVersion in the frame prefix.
@0xad5cf8cd480dedbe;

$import "/capnp/c++.capnp".namespace("distgrad::rpc::wire");

struct Envelope {
  messageId @0 :UInt64;
  kind @1 :Kind;
  # Name of the remote function (call) or of the function a response answers (for diagnostics).
  functionName @2 :Text;
  # FNV-1a 64 of the function's type signature "R(Args...)"; the callee rejects a mismatch.
  signatureHash @3 :UInt64;
  # Absolute deadline (microseconds since the Unix epoch) and the caller's timeout; 0 means none.
  deadlineUnixMicros @4 :Int64;
  timeoutMicros @5 :Int64;
  traceId @6 :UInt64;
  spanId @7 :UInt64;
  # Distributed autograd: set only when the message is sent inside a context.
  hasAutogradContext @8 :Bool;
  autogradContextId @9 :UInt64;
  autogradMessageId @10 :UInt64;
  # call: the arguments as a struct with empty names (a tuple); response: the result; others: per kind.
  value @11 :Value;
  # kind == error: what went wrong.
  error @12 :ErrorInfo;
  # Must equal the frame's payload count: every payload is referenced by exactly one TensorDesc.
  payloadCount @13 :UInt32;
  # Distributed autograd, on a message with grad tensors: the autograd message ids of every message whose
  # received tensors its own are computed from, transitively (the sender's record of the forward; at most
  # kMaxAutogradClosure ids). autogradClosureKnown false: the sender could not bound it.
  autogradClosure @14 :List(UInt64);
  autogradClosureKnown @15 :Bool;
  # The remote references (RRef forks, rref/) written anywhere in `value`, so a receiver that never decodes
  # the value (an unknown function, a refused or expired call, a reply nobody waits for) can still settle
  # them (docs/rref_protocol.md, Note [Unclaimed references]).
  references @16 :List(CarriedReference);
  # CUDA tensors over RPC (docs/cuda.md): the device map the sender applied to the CUDA tensors of `value`
  # (its cuda:source -> the receiver's cuda:target), written whenever the sender had one for this message.
  # One-to-one, indices in [0, 64). The receiver answers a call (and sends gradients back to a message of an
  # autograd context) with the inverse map.
  deviceMap @17 :List(DevicePair);

  enum Kind {
    call @0;
    response @1;
    error @2;
    cancel @3;
    rrefControl @4;
    autogradControl @5;
    heartbeat @6;
    handshake @7;
  }
}

struct ErrorInfo {
  kind @0 :ErrorKind;
  message @1 :Text;
  worker @2 :Text;
  remoteType @3 :Text;

  # Mirrors distgrad::rpc::ErrorKind (same numbering).
  enum ErrorKind {
    failed @0;
    overloaded @1;
    disconnected @2;
    unimplemented @3;
    timeout @4;
    cancelled @5;
    remote @6;
  }
}

# The value tree: arguments, results and control payloads.
struct Value {
  union {
    null @0 :Void;
    bool @1 :Bool;
    int64 @2 :Int64;
    uint64 @3 :UInt64;
    float64 @4 :Float64;
    text @5 :Text;
    data @6 :Data;
    list @7 :List(Value);
    map @8 :List(MapEntry);
    # Named fields of a user struct; tuples use the same shape with empty names.
    struct @9 :List(Field);
    # std::optional: the target is a Value whose `null` member means "no value".
    optional @10 :Value;
    tensor @11 :TensorDesc;
    rrefId @12 :RRefId;
  }
}

struct MapEntry {
  key @0 :Value;
  value @1 :Value;
}

struct Field {
  name @0 :Text;
  value @1 :Value;
}

# A tensor whose bytes are payload `payloadIndex` of the frame, laid out contiguously (row-major).
struct TensorDesc {
  dtype @0 :UInt8;            # distgrad::tensor::DType code
  shape @1 :List(Int64);
  strides @2 :List(Int64);    # of the payload as sent: always the contiguous strides of `shape`
  # Where the receiver puts the tensor: deviceType is a distgrad::tensor::DeviceType code; for CUDA
  # (1), deviceIndex is the receiver's device (the sender's index through the message's device map), in
  # [0, 64) and below the receiver's device count; for CPU (0) it is -1 (0, Cap'n Proto's default, is
  # accepted from writers that leave it unset). The payload holds the bytes in host memory either way.
  deviceType @3 :UInt8;
  deviceIndex @4 :Int16;
  payloadIndex @5 :UInt32;
  byteLength @6 :UInt64;      # == product(shape) * itemSize(dtype) == the payload's size
  # Distributed autograd: the sender's tensor requires grad (only in a message with an autograd context,
  # floating dtypes only); the receiver's copy hangs from the message's RecvBackward node.
  requiresGrad @7 :Bool;
}

# One entry of a device map: the sender's cuda:source lands on the receiver's cuda:target.
struct DevicePair {
  source @0 :Int16;
  target @1 :Int16;
}

# One remote reference carried by a message: the RRef and the fork the sender made for the receiver.
struct CarriedReference {
  id @0 :RRefId;
  fork @1 :UInt64;
}

# Globally unique id of a remote reference (issue 4): the owner's worker id and its local counter.
struct RRefId {
  ownerWorkerId @0 :UInt32;
  localId @1 :UInt64;
}
