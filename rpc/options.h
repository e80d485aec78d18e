// Options: everything an Agent needs to join a job (who am I, how many are we, where is the rendezvous),
// read from the environment the job was launched in or filled in explicitly.
//
// Options::fromEnv() understands the launchers people actually use, so the same binary runs under
// `distgrad-run`, `torchrun`, `srun` and `mpirun`:
//   explicit DISTGRAD_*   DISTGRAD_RANK, DISTGRAD_WORLD_SIZE, DISTGRAD_LOCAL_RANK, DISTGRAD_MASTER_ADDR,
//                         DISTGRAD_MASTER_PORT
//   torchrun / distgrad-run   RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
//   Slurm                 SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, first host of SLURM_JOB_NODELIST
//                         (or SLURM_NODELIST), compressed forms such as "node[01-04,07]" expanded
//   Open MPI              OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
// Precedence: DISTGRAD_* > torchrun > Slurm > Open MPI. The rank, world size and local rank come together
// from the first style whose rank variable is set (mixing, say, RANK with SLURM_NTASKS would silently build
// an inconsistent job under `srun torchrun`). The master address is DISTGRAD_MASTER_ADDR, else MASTER_ADDR,
// else (Slurm) the first node of the allocation; the port DISTGRAD_MASTER_PORT, else MASTER_PORT, else
// kDefaultMasterPort for Slurm / Open MPI jobs (torchrun's default). With none of them set the process is a
// single worker (rank 0 of 1).
// Other variables: DISTGRAD_SECRET (handshake secret), DISTGRAD_TRANSPORT (tcp|inproc|ucx),
// DISTGRAD_WORKER_NAME (default "worker<rank>"), DISTGRAD_RPC_TIMEOUT_MS, DISTGRAD_STORE (host:port of an
// existing rendezvous store; then no rank hosts one), DISTGRAD_EXECUTOR_THREADS,
// DISTGRAD_HEARTBEAT_INTERVAL_MS, DISTGRAD_HEARTBEAT_TIMEOUT_MS, DISTGRAD_MAX_MESSAGE_BYTES,
// DISTGRAD_RENDEZVOUS_TIMEOUT_MS, DISTGRAD_TRACE (trace directory, see traceDir).
// Every value is validated; a bad one throws distgrad::ValueError naming the variable and its value.
// Thread-safety: Options is a value type. fromEnv() reads the process environment once (getenv is not safe
// against concurrent setenv); fromEnv(map) reads nothing global and is what tests use.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "rpc/device_map.h"

namespace distgrad::rpc {

// torchrun's default rendezvous port; used when a Slurm or Open MPI job names no port.
inline constexpr int kDefaultMasterPort = 29500;

struct Options {
  // Identity in the job.
  std::string workerName;  // unique per job; empty means "worker<rank>" (see name())
  int rank = 0;
  int worldSize = 1;
  int localRank = 0;  // index among the workers on this machine (picks the GPU)

  // Rendezvous: rank 0 hosts the store at masterAddr:masterPort unless storeAddr names an existing one.
  std::string masterAddr = "127.0.0.1";
  int masterPort = 0;  // 0: any free port (only meaningful for a single-worker job or rank 0 in tests)
  std::string storeAddr;  // "host:port" of an existing store, or empty
  std::chrono::milliseconds rendezvousTimeout{300'000};

  // Transport and execution.
  std::string transport = "tcp";
  std::chrono::milliseconds defaultTimeout{60'000};  // deadline of an rpc that names none
  int executorThreads = 4;
  std::string secret;  // DISTGRAD_SECRET; empty means no authentication (single-user machines, tests)
  std::chrono::milliseconds heartbeatInterval{500};
  std::chrono::milliseconds heartbeatTimeout{2'000};  // a peer silent this long is declared dead
  uint64_t maxMessageBytes = 16ull << 30;               // largest frame (envelope + payloads) accepted

  // Tracing (rpc/trace.h, docs/tracing.md): when set, the agent records spans from start-up and writes
  // traceDir/<worker>.trace.jsonl (the directory is created) when it shuts down. Empty: off.
  std::string traceDir;

  // CUDA tensors over RPC (rpc/device_map.h, docs/cuda.md): per destination worker, where this worker's
  // CUDA devices land there. A CUDA tensor sent to a worker with no entry for its device is refused at the
  // sender. Checked by Agent::start: every worker named must be in the job and have the target devices.
  std::map<std::string, DeviceMap> deviceMaps;
  // Sets deviceMaps[worker] (ValueError for an empty worker name; the map validated itself when built).
  Options& setDeviceMap(const std::string& worker, DeviceMap map);

  // Where the rank came from ("explicit", "distgrad", "torchrun", "slurm", "openmpi"), for log messages.
  std::string source = "explicit";

  // Options for this process from its environment (see the header comment for the variables).
  static Options fromEnv();
  // The same from an explicit variable map: no global state is read.
  static Options fromEnv(const std::map<std::string, std::string>& env);

  // Throws distgrad::ValueError naming the field and value when something is inconsistent (rank outside
  // [0, worldSize), port outside [0, 65535], empty worker name, heartbeat timeout <= interval, ...).
  void validate() const;

  // The worker's name: workerName, or "worker<rank>" when it is empty.
  std::string name() const { return workerName.empty() ? "worker" + std::to_string(rank) : workerName; }

  // The store address every worker connects to: storeAddr if set, else masterAddr:masterPort.
  std::string rendezvousAddress() const;
};

// Expands a Slurm node list ("node[01-04,07]", "a1,b2", "gpu-[3-5]x", "r[1-2]-n[01-02]") into host
// names, keeping zero padding. `variable` names the source in error messages. Throws distgrad::ValueError on
// malformed input (unbalanced brackets, empty or reversed ranges, non-numeric bounds) or when the expansion
// would exceed `maxHosts`.
std::vector<std::string> expandSlurmNodelist(std::string_view nodelist, std::string_view variable = "SLURM_NODELIST",
                                             size_t maxHosts = 1u << 20);
// The first host of a Slurm node list without expanding the rest.
std::string firstSlurmHost(std::string_view nodelist, std::string_view variable = "SLURM_NODELIST");

// Splits "host:port" / "[v6addr]:port" and checks the port is in [0, 65535]. `what` names the source in
// error messages.
std::pair<std::string, int> parseHostPort(std::string_view address, std::string_view what);

}  // namespace distgrad::rpc
