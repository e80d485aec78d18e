#include "rpc/options.h"

#include <charconv>
#include <cstdlib>
#include <limits>
#include <optional>

#include "tensor/error.h"

extern char** environ;

namespace distgrad::rpc {

namespace {

using Env = std::map<std::string, std::string>;

std::optional<std::string> lookup(const Env& env, const std::string& name) {
  auto it = env.find(name);
  if (it == env.end()) return std::nullopt;
  return it->second;
}

// A whole-string decimal integer in [lo, hi]; anything else names the variable and its value.
int64_t parseInteger(std::string_view text, std::string_view variable, int64_t lo, int64_t hi) {
  int64_t value = 0;
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(begin, end, value);
  DG_CHECK(!text.empty() && ec != std::errc::invalid_argument && ptr == end, "Options: ", variable, "='", text,
           "' is not an integer");
  DG_CHECK(ec != std::errc::result_out_of_range && value >= lo && value <= hi, "Options: ", variable, "='", text,
           "' is out of range: expected a value in [", lo, ", ", hi, "]");
  return value;
}

std::optional<int64_t> integerVar(const Env& env, const std::string& name, int64_t lo, int64_t hi) {
  auto text = lookup(env, name);
  if (!text) return std::nullopt;
  return parseInteger(*text, name, lo, hi);
}

// One launcher style's variable names for the rank triple.
struct RankStyle {
  const char* source;
  const char* rank;
  const char* worldSize;
  const char* localRank;
};

constexpr RankStyle kRankStyles[] = {
    {"distgrad", "DISTGRAD_RANK", "DISTGRAD_WORLD_SIZE", "DISTGRAD_LOCAL_RANK"},
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
    {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
};

constexpr int64_t kMaxWorldSize = 1 << 24;

// --- Slurm node lists -------------------------------------------------------------------------------------

struct NumberRange {
  uint64_t lo = 0;
  uint64_t hi = 0;
  size_t width = 0;  // zero-padding width (the lower bound's digit count)
};

// A host pattern: literal text and bracket groups alternating, e.g. "r" [1-2] "-n" [01-02].
struct Segment {
  std::string literal;             // used when ranges is empty
  std::vector<NumberRange> ranges;  // a bracket group
};
using HostPattern = std::vector<Segment>;

[[noreturn]] void nodelistError(std::string_view variable, std::string_view nodelist, const std::string& why) {
  throw ValueError(detail::concatMessage("Options: ", variable, "='", nodelist,
                                        "' is not a valid Slurm node list: ", why));
}

uint64_t parseBound(std::string_view digits, std::string_view variable, std::string_view nodelist) {
  if (digits.empty()) nodelistError(variable, nodelist, "empty number in a bracket range");
  if (digits.size() > 18) nodelistError(variable, nodelist, "number '" + std::string(digits) + "' is too long");
  uint64_t value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') {
      nodelistError(variable, nodelist, "'" + std::string(digits) + "' in a bracket range is not a number");
    }
    value = value * 10 + static_cast<uint64_t>(c - '0');
  }
  return value;
}

std::vector<NumberRange> parseBracket(std::string_view body, std::string_view variable, std::string_view nodelist) {
  std::vector<NumberRange> ranges;
  size_t start = 0;
  while (true) {
    size_t comma = body.find(',', start);
    std::string_view part = body.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    if (part.empty()) nodelistError(variable, nodelist, "empty entry inside brackets");
    NumberRange range;
    const size_t dash = part.find('-');
    if (dash == std::string_view::npos) {
      range.lo = range.hi = parseBound(part, variable, nodelist);
      range.width = part.size();
    } else {
      std::string_view loText = part.substr(0, dash);
      std::string_view hiText = part.substr(dash + 1);
      range.lo = parseBound(loText, variable, nodelist);
      range.hi = parseBound(hiText, variable, nodelist);
      range.width = loText.size();
      if (range.hi < range.lo) {
        nodelistError(variable, nodelist, "range '" + std::string(part) + "' runs backwards");
      }
    }
    ranges.push_back(range);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return ranges;
}

std::vector<HostPattern> parseNodelist(std::string_view nodelist, std::string_view variable) {
  if (nodelist.empty()) nodelistError(variable, nodelist, "it is empty");
  std::vector<HostPattern> hosts;
  HostPattern current;
  std::string literal;
  auto finishHost = [&] {
    if (!literal.empty()) current.push_back({std::move(literal), {}});
    literal.clear();
    if (current.empty()) nodelistError(variable, nodelist, "empty host name");
    hosts.push_back(std::move(current));
    current.clear();
  };
  for (size_t i = 0; i < nodelist.size(); ++i) {
    const char c = nodelist[i];
    if (c == ',') {
      finishHost();
    } else if (c == '[') {
      const size_t close = nodelist.find(']', i + 1);
      if (close == std::string_view::npos) nodelistError(variable, nodelist, "'[' without a matching ']'");
      std::string_view body = nodelist.substr(i + 1, close - i - 1);
      if (body.find('[') != std::string_view::npos) nodelistError(variable, nodelist, "nested '['");
      if (!literal.empty()) current.push_back({std::move(literal), {}});
      literal.clear();
      current.push_back({{}, parseBracket(body, variable, nodelist)});
      i = close;
    } else if (c == ']') {
      nodelistError(variable, nodelist, "']' without a matching '['");
    } else if (c == ' ' || c == '\t' || c == '\n') {
      nodelistError(variable, nodelist, "whitespace in a host name");
    } else {
      literal.push_back(c);
    }
  }
  finishHost();
  return hosts;
}

std::string formatNumber(uint64_t value, size_t width) {
  std::string digits = std::to_string(value);
  if (digits.size() < width) digits.insert(0, width - digits.size(), '0');
  return digits;
}

}  // namespace

std::vector<std::string> expandSlurmNodelist(std::string_view nodelist, std::string_view variable, size_t maxHosts) {
  std::vector<std::string> out;
  for (const HostPattern& pattern : parseNodelist(nodelist, variable)) {
    std::vector<std::string> partial{""};
    for (const Segment& segment : pattern) {
      if (segment.ranges.empty()) {
        for (std::string& p : partial) p += segment.literal;
        continue;
      }
      uint64_t count = 0;
      for (const NumberRange& r : segment.ranges) count += r.hi - r.lo + 1;
      DG_CHECK(count <= maxHosts && partial.size() * count + out.size() <= maxHosts, "Options: ", variable, "='",
               nodelist, "' expands to more than ", maxHosts, " hosts");
      std::vector<std::string> next;
      next.reserve(partial.size() * count);
      for (const std::string& p : partial) {
        for (const NumberRange& r : segment.ranges) {
          for (uint64_t v = r.lo; v <= r.hi; ++v) next.push_back(p + formatNumber(v, r.width));
        }
      }
      partial = std::move(next);
    }
    DG_CHECK(out.size() + partial.size() <= maxHosts, "Options: ", variable, "='", nodelist,
             "' expands to more than ", maxHosts, " hosts");
    for (std::string& p : partial) out.push_back(std::move(p));
  }
  return out;
}

std::string firstSlurmHost(std::string_view nodelist, std::string_view variable) {
  // Parse everything (so a malformed tail is still reported), but build only the first name.
  const std::vector<HostPattern> hosts = parseNodelist(nodelist, variable);
  std::string first;
  for (const Segment& segment : hosts.front()) {
    first += segment.ranges.empty() ? segment.literal : formatNumber(segment.ranges.front().lo, segment.ranges.front().width);
  }
  return first;
}

std::pair<std::string, int> parseHostPort(std::string_view address, std::string_view what) {
  std::string host;
  std::string_view portText;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    DG_CHECK(close != std::string_view::npos && close + 1 < address.size() && address[close + 1] == ':', what, "='",
             address, "' is not a valid address: expected [ipv6]:port");
    host = std::string(address.substr(1, close - 1));
    portText = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    DG_CHECK(colon != std::string_view::npos, what, "='", address, "' is not a valid address: expected host:port");
    host = std::string(address.substr(0, colon));
    portText = address.substr(colon + 1);
    DG_CHECK(host.find(':') == std::string::npos, what, "='", address,
             "' is not a valid address: write IPv6 addresses as [addr]:port");
  }
  DG_CHECK(!host.empty(), what, "='", address, "' is not a valid address: the host is empty");
  int port = -1;
  auto [ptr, ec] = std::from_chars(portText.data(), portText.data() + portText.size(), port);
  DG_CHECK(!portText.empty() && ec == std::errc() && ptr == portText.data() + portText.size() && port >= 0 &&
               port <= 65535,
           what, "='", address, "' has an invalid port '", portText, "': expected an integer in [0, 65535]");
  return {host, port};
}

Options Options::fromEnv() {
  // Snapshot only the variables we understand, so tests and logs see exactly what was used.
  Env env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string_view text(*entry);
    const size_t eq = text.find('=');
    if (eq == std::string_view::npos) continue;
    std::string_view name = text.substr(0, eq);
    const bool ours = name.starts_with("DISTGRAD_") || name.starts_with("SLURM_") || name.starts_with("OMPI_COMM_WORLD_") ||
                      name == "RANK" || name == "WORLD_SIZE" || name == "LOCAL_RANK" || name == "MASTER_ADDR" ||
                      name == "MASTER_PORT";
    if (ours) env.emplace(std::string(name), std::string(text.substr(eq + 1)));
  }
  return fromEnv(env);
}

Options Options::fromEnv(const std::map<std::string, std::string>& env) {
  Options options;

  // Rank, world size, local rank: all three from the first style whose rank variable is present.
  const RankStyle* style = nullptr;
  for (const RankStyle& candidate : kRankStyles) {
    if (env.count(candidate.rank) != 0) {
      style = &candidate;
      break;
    }
  }
  if (style == nullptr) {
    // A world size without a rank is a launcher we half understand: refuse rather than guess rank 0.
    for (const RankStyle& candidate : kRankStyles) {
      DG_CHECK(env.count(candidate.worldSize) == 0, "Options: ", candidate.worldSize, "='",
               env.at(candidate.worldSize), "' is set but ", candidate.rank, " is not");
    }
    options.source = "default";
  } else {
    options.source = style->source;
    auto worldSize = integerVar(env, style->worldSize, 1, kMaxWorldSize);
    DG_CHECK(worldSize.has_value(), "Options: ", style->rank, "='", env.at(style->rank), "' is set but ",
             style->worldSize, " is not");
    options.worldSize = static_cast<int>(*worldSize);
    const int64_t rank = parseInteger(env.at(style->rank), style->rank, 0, kMaxWorldSize);
    DG_CHECK(rank < options.worldSize, "Options: ", style->rank, "='", env.at(style->rank),
             "' is out of range: expected a rank in [0, ", options.worldSize, ") since ", style->worldSize, "=",
             options.worldSize);
    options.rank = static_cast<int>(rank);
    auto localRank = integerVar(env, style->localRank, 0, options.worldSize - 1);
    options.localRank = localRank ? static_cast<int>(*localRank) : 0;
  }

  // Master address: explicit, torchrun-style, then the first node of a Slurm allocation.
  bool haveMasterAddr = false;
  if (auto addr = lookup(env, "DISTGRAD_MASTER_ADDR")) {
    DG_CHECK(!addr->empty(), "Options: DISTGRAD_MASTER_ADDR is set but empty");
    options.masterAddr = *addr;
    haveMasterAddr = true;
  } else if (auto addr = lookup(env, "MASTER_ADDR")) {
    DG_CHECK(!addr->empty(), "Options: MASTER_ADDR is set but empty");
    options.masterAddr = *addr;
    haveMasterAddr = true;
  } else if (auto list = lookup(env, "SLURM_JOB_NODELIST")) {
    options.masterAddr = firstSlurmHost(*list, "SLURM_JOB_NODELIST");
    haveMasterAddr = true;
  } else if (auto list = lookup(env, "SLURM_NODELIST")) {
    options.masterAddr = firstSlurmHost(*list, "SLURM_NODELIST");
    haveMasterAddr = true;
  }

  bool havePort = false;
  if (auto port = integerVar(env, "DISTGRAD_MASTER_PORT", 1, 65535)) {
    options.masterPort = static_cast<int>(*port);
    havePort = true;
  } else if (auto port = integerVar(env, "MASTER_PORT", 1, 65535)) {
    options.masterPort = static_cast<int>(*port);
    havePort = true;
  }

  if (auto store = lookup(env, "DISTGRAD_STORE")) {
    auto [host, port] = parseHostPort(*store, "Options: DISTGRAD_STORE");
    DG_CHECK(port != 0, "Options: DISTGRAD_STORE='", *store, "' has port 0: an existing store has a real port");
    options.storeAddr = *store;
  }

  // A multi-worker job must know where to meet.
  if (options.worldSize > 1 && options.storeAddr.empty()) {
    DG_CHECK(haveMasterAddr, "Options: missing master address for a ", options.worldSize, "-worker job (",
             options.source,
             " environment): set MASTER_ADDR (or DISTGRAD_MASTER_ADDR, SLURM_JOB_NODELIST, DISTGRAD_STORE)");
    if (!havePort) {
      DG_CHECK(options.source == "slurm" || options.source == "openmpi", "Options: missing master port for a ",
               options.worldSize, "-worker job (", options.source, " environment): set MASTER_PORT");
      options.masterPort = kDefaultMasterPort;
    }
  }

  if (auto name = lookup(env, "DISTGRAD_WORKER_NAME")) {
    DG_CHECK(!name->empty(), "Options: DISTGRAD_WORKER_NAME is set but empty");
    options.workerName = *name;
  } else {
    options.workerName = "worker" + std::to_string(options.rank);
  }
  if (auto transport = lookup(env, "DISTGRAD_TRANSPORT")) options.transport = *transport;
  if (auto secret = lookup(env, "DISTGRAD_SECRET")) options.secret = *secret;
  if (auto dir = lookup(env, "DISTGRAD_TRACE")) {
    // Set but empty is a mistake (a launcher expanding an unset variable): refuse rather than not trace.
    DG_CHECK(!dir->empty(), "Options: DISTGRAD_TRACE is set but empty (expected the trace directory)");
    options.traceDir = *dir;
  }

  constexpr int64_t kMaxMs = int64_t{7} * 24 * 3600 * 1000;  // a week: anything longer is a typo
  if (auto ms = integerVar(env, "DISTGRAD_RPC_TIMEOUT_MS", 1, kMaxMs)) {
    options.defaultTimeout = std::chrono::milliseconds(*ms);
  }
  if (auto ms = integerVar(env, "DISTGRAD_RENDEZVOUS_TIMEOUT_MS", 1, kMaxMs)) {
    options.rendezvousTimeout = std::chrono::milliseconds(*ms);
  }
  if (auto ms = integerVar(env, "DISTGRAD_HEARTBEAT_INTERVAL_MS", 1, kMaxMs)) {
    options.heartbeatInterval = std::chrono::milliseconds(*ms);
  }
  if (auto ms = integerVar(env, "DISTGRAD_HEARTBEAT_TIMEOUT_MS", 1, kMaxMs)) {
    options.heartbeatTimeout = std::chrono::milliseconds(*ms);
  }
  if (auto threads = integerVar(env, "DISTGRAD_EXECUTOR_THREADS", 1, 1024)) {
    options.executorThreads = static_cast<int>(*threads);
  }
  if (auto bytes = integerVar(env, "DISTGRAD_MAX_MESSAGE_BYTES", 1024, std::numeric_limits<int64_t>::max())) {
    options.maxMessageBytes = static_cast<uint64_t>(*bytes);
  }

  options.validate();
  return options;
}

void Options::validate() const {
  DG_CHECK(worldSize >= 1, "Options: worldSize must be >= 1, got ", worldSize);
  DG_CHECK(rank >= 0 && rank < worldSize, "Options: rank must be in [0, ", worldSize, "), got ", rank);
  DG_CHECK(localRank >= 0 && localRank < worldSize, "Options: localRank must be in [0, ", worldSize, "), got ",
           localRank);
  DG_CHECK(masterPort >= 0 && masterPort <= 65535, "Options: masterPort must be in [0, 65535], got ", masterPort);
  DG_CHECK(!masterAddr.empty() || !storeAddr.empty(), "Options: masterAddr is empty and no storeAddr is given");
  if (!storeAddr.empty()) (void)parseHostPort(storeAddr, "Options: storeAddr");
  DG_CHECK(workerName.size() <= 255, "Options: the worker name '", workerName, "' is longer than 255 bytes");
  for (char c : workerName) {
    const auto u = static_cast<unsigned char>(c);
    DG_CHECK(u > 0x20 && u != 0x7f, "Options: the worker name '", workerName,
             "' contains whitespace or a control character");
  }
  DG_CHECK(transport == "tcp" || transport == "inproc" || transport == "ucx", "Options: transport (DISTGRAD_TRANSPORT) must be one of tcp, inproc, ucx; got '",
           transport, "'");
  DG_CHECK(defaultTimeout.count() > 0, "Options: defaultTimeout must be > 0 ms, got ", defaultTimeout.count());
  DG_CHECK(rendezvousTimeout.count() > 0, "Options: rendezvousTimeout must be > 0 ms, got ",
           rendezvousTimeout.count());
  DG_CHECK(executorThreads >= 1, "Options: executorThreads must be >= 1, got ", executorThreads);
  DG_CHECK(heartbeatInterval.count() > 0, "Options: heartbeatInterval must be > 0 ms, got ",
           heartbeatInterval.count());
  DG_CHECK(heartbeatTimeout > heartbeatInterval, "Options: heartbeatTimeout (", heartbeatTimeout.count(),
           " ms) must be longer than heartbeatInterval (", heartbeatInterval.count(), " ms)");
  DG_CHECK(maxMessageBytes >= 1024, "Options: maxMessageBytes must be >= 1024, got ", maxMessageBytes);
  for (const auto& [worker, map] : deviceMaps) {
    DG_CHECK(!worker.empty(), "Options: deviceMaps has an entry for an empty worker name (map ", map.str(), ")");
  }
}

Options& Options::setDeviceMap(const std::string& worker, DeviceMap map) {
  DG_CHECK(!worker.empty(), "Options::setDeviceMap: the worker name is empty (map ", map.str(), ")");
  deviceMaps[worker] = std::move(map);
  return *this;
}

std::string Options::rendezvousAddress() const {
  if (!storeAddr.empty()) return storeAddr;
  if (masterAddr.find(':') != std::string::npos) return "[" + masterAddr + "]:" + std::to_string(masterPort);
  return masterAddr + ":" + std::to_string(masterPort);
}

}  // namespace distgrad::rpc
