#include "rpc/options.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "tensor/error.h"

namespace distgrad::rpc {
namespace {

using Env = std::map<std::string, std::string>;

// Expects fromEnv(env) to throw a ValueError whose message contains every fragment.
void expectEnvError(const Env& env, std::initializer_list<const char*> fragments) {
  try {
    Options::fromEnv(env);
    ADD_FAILURE() << "expected a ValueError";
  } catch (const ValueError& e) {
    for (const char* f : fragments) {
      EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << "'" << f << "' not in: " << e.what();
    }
  }
}

TEST(Options, EmptyEnvironmentIsASingleWorker) {
  const Options o = Options::fromEnv(Env{});
  EXPECT_EQ(o.rank, 0);
  EXPECT_EQ(o.worldSize, 1);
  EXPECT_EQ(o.localRank, 0);
  EXPECT_EQ(o.workerName, "worker0");
  EXPECT_EQ(o.transport, "tcp");
  EXPECT_EQ(o.source, "default");
  EXPECT_TRUE(o.secret.empty());
  EXPECT_TRUE(o.storeAddr.empty());
  EXPECT_TRUE(o.traceDir.empty()) << "tracing is off unless asked for";
}

TEST(Options, Torchrun) {
  const Options o = Options::fromEnv(
      Env{{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "10.0.0.5"}, {"MASTER_PORT", "29400"}});
  EXPECT_EQ(o.rank, 3);
  EXPECT_EQ(o.worldSize, 8);
  EXPECT_EQ(o.localRank, 1);
  EXPECT_EQ(o.masterAddr, "10.0.0.5");
  EXPECT_EQ(o.masterPort, 29400);
  EXPECT_EQ(o.workerName, "worker3");
  EXPECT_EQ(o.source, "torchrun");
  EXPECT_EQ(o.rendezvousAddress(), "10.0.0.5:29400");
}

TEST(Options, Slurm) {
  const Options o = Options::fromEnv(Env{{"SLURM_PROCID", "5"},
                                         {"SLURM_NTASKS", "16"},
                                         {"SLURM_LOCALID", "1"},
                                         {"SLURM_JOB_NODELIST", "gpu-node[07-10,12]"}});
  EXPECT_EQ(o.rank, 5);
  EXPECT_EQ(o.worldSize, 16);
  EXPECT_EQ(o.localRank, 1);
  EXPECT_EQ(o.masterAddr, "gpu-node07");
  EXPECT_EQ(o.masterPort, kDefaultMasterPort);
  EXPECT_EQ(o.source, "slurm");
}

TEST(Options, SlurmOlderNodelistVariableAndMasterOverrides) {
  const Options o = Options::fromEnv(Env{{"SLURM_PROCID", "0"},
                                         {"SLURM_NTASKS", "2"},
                                         {"SLURM_LOCALID", "0"},
                                         {"SLURM_NODELIST", "a1,b2"},
                                         {"MASTER_PORT", "1234"}});
  EXPECT_EQ(o.masterAddr, "a1");
  EXPECT_EQ(o.masterPort, 1234);
  // MASTER_ADDR wins over the node list.
  const Options p = Options::fromEnv(Env{{"SLURM_PROCID", "1"},
                                         {"SLURM_NTASKS", "2"},
                                         {"SLURM_JOB_NODELIST", "n[1-2]"},
                                         {"MASTER_ADDR", "head.cluster"},
                                         {"MASTER_PORT", "4000"}});
  EXPECT_EQ(p.masterAddr, "head.cluster");
  EXPECT_EQ(p.masterPort, 4000);
  // SLURM_JOB_NODELIST is preferred over the older SLURM_NODELIST.
  const Options q = Options::fromEnv(Env{{"SLURM_PROCID", "1"},
                                         {"SLURM_NTASKS", "2"},
                                         {"SLURM_JOB_NODELIST", "job[3-4]"},
                                         {"SLURM_NODELIST", "old[1-2]"}});
  EXPECT_EQ(q.masterAddr, "job3");
}

TEST(Options, OpenMpi) {
  const Options o = Options::fromEnv(Env{{"OMPI_COMM_WORLD_RANK", "2"},
                                         {"OMPI_COMM_WORLD_SIZE", "4"},
                                         {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                         {"MASTER_ADDR", "host0"}});
  EXPECT_EQ(o.rank, 2);
  EXPECT_EQ(o.worldSize, 4);
  EXPECT_EQ(o.localRank, 0);
  EXPECT_EQ(o.masterAddr, "host0");
  EXPECT_EQ(o.masterPort, kDefaultMasterPort);
  EXPECT_EQ(o.source, "openmpi");
}

TEST(Options, OpenMpiWithoutMasterAddressFails) {
  expectEnvError(Env{{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"}},
                 {"missing master address", "openmpi", "MASTER_ADDR"});
}

TEST(Options, Precedence) {
  // DISTGRAD_* > torchrun > Slurm > Open MPI, as a group (rank, world size, local rank together).
  Env all{{"DISTGRAD_RANK", "1"},        {"DISTGRAD_WORLD_SIZE", "2"}, {"DISTGRAD_LOCAL_RANK", "1"},
          {"RANK", "3"},                 {"WORLD_SIZE", "4"},          {"LOCAL_RANK", "2"},
          {"SLURM_PROCID", "5"},         {"SLURM_NTASKS", "6"},        {"SLURM_LOCALID", "3"},
          {"OMPI_COMM_WORLD_RANK", "6"}, {"OMPI_COMM_WORLD_SIZE", "7"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "4"},
          {"MASTER_ADDR", "m"},          {"MASTER_PORT", "100"},       {"SLURM_JOB_NODELIST", "s[1-3]"}};
  Options o = Options::fromEnv(all);
  EXPECT_EQ(o.source, "distgrad");
  EXPECT_EQ(o.rank, 1);
  EXPECT_EQ(o.worldSize, 2);
  EXPECT_EQ(o.localRank, 1);
  all.erase("DISTGRAD_RANK");
  all.erase("DISTGRAD_WORLD_SIZE");
  all.erase("DISTGRAD_LOCAL_RANK");
  o = Options::fromEnv(all);
  EXPECT_EQ(o.source, "torchrun");
  EXPECT_EQ(o.rank, 3);
  EXPECT_EQ(o.worldSize, 4);
  EXPECT_EQ(o.localRank, 2);
  all.erase("RANK");
  all.erase("WORLD_SIZE");
  all.erase("LOCAL_RANK");
  o = Options::fromEnv(all);
  EXPECT_EQ(o.source, "slurm");
  EXPECT_EQ(o.rank, 5);
  EXPECT_EQ(o.worldSize, 6);
  EXPECT_EQ(o.masterAddr, "m");  // MASTER_ADDR still overrides the node list
  all.erase("SLURM_PROCID");
  all.erase("SLURM_NTASKS");
  all.erase("SLURM_LOCALID");
  o = Options::fromEnv(all);
  EXPECT_EQ(o.source, "openmpi");
  EXPECT_EQ(o.rank, 6);
  EXPECT_EQ(o.worldSize, 7);
  EXPECT_EQ(o.localRank, 4);
  // Explicit master variables beat MASTER_ADDR/MASTER_PORT.
  all["DISTGRAD_MASTER_ADDR"] = "explicit";
  all["DISTGRAD_MASTER_PORT"] = "200";
  o = Options::fromEnv(all);
  EXPECT_EQ(o.masterAddr, "explicit");
  EXPECT_EQ(o.masterPort, 200);
}

TEST(Options, DistgradVariables) {
  const Options o = Options::fromEnv(Env{{"RANK", "1"},
                                         {"WORLD_SIZE", "2"},
                                         {"MASTER_ADDR", "127.0.0.1"},
                                         {"MASTER_PORT", "5000"},
                                         {"DISTGRAD_SECRET", "s3cret"},
                                         {"DISTGRAD_TRANSPORT", "inproc"},
                                         {"DISTGRAD_WORKER_NAME", "trainer-1"},
                                         {"DISTGRAD_RPC_TIMEOUT_MS", "2500"},
                                         {"DISTGRAD_STORE", "store.host:7000"},
                                         {"DISTGRAD_EXECUTOR_THREADS", "8"},
                                         {"DISTGRAD_HEARTBEAT_INTERVAL_MS", "200"},
                                         {"DISTGRAD_HEARTBEAT_TIMEOUT_MS", "3000"},
                                         {"DISTGRAD_MAX_MESSAGE_BYTES", "1048576"},
                                         {"DISTGRAD_RENDEZVOUS_TIMEOUT_MS", "9000"},
                                         {"DISTGRAD_TRACE", "/tmp/traces"}});
  EXPECT_EQ(o.secret, "s3cret");
  EXPECT_EQ(o.traceDir, "/tmp/traces");
  EXPECT_EQ(o.transport, "inproc");
  EXPECT_EQ(o.workerName, "trainer-1");
  EXPECT_EQ(o.defaultTimeout.count(), 2500);
  EXPECT_EQ(o.storeAddr, "store.host:7000");
  EXPECT_EQ(o.rendezvousAddress(), "store.host:7000");
  EXPECT_EQ(o.executorThreads, 8);
  EXPECT_EQ(o.heartbeatInterval.count(), 200);
  EXPECT_EQ(o.heartbeatTimeout.count(), 3000);
  EXPECT_EQ(o.maxMessageBytes, 1048576u);
  EXPECT_EQ(o.rendezvousTimeout.count(), 9000);
}

TEST(Options, StoreAddressReplacesMasterAddress) {
  const Options o = Options::fromEnv(Env{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"DISTGRAD_STORE", "[::1]:7000"}});
  EXPECT_EQ(o.rendezvousAddress(), "[::1]:7000");
}

TEST(Options, ValidationErrorsNameTheVariableAndValue) {
  expectEnvError(Env{{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}},
                 {"RANK='4'", "out of range", "[0, 4)"});
  expectEnvError(Env{{"RANK", "-1"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}},
                 {"RANK='-1'", "out of range"});
  expectEnvError(Env{{"RANK", "one"}, {"WORLD_SIZE", "4"}}, {"RANK='one'", "not an integer"});
  expectEnvError(Env{{"RANK", "1x"}, {"WORLD_SIZE", "4"}}, {"RANK='1x'", "not an integer"});
  expectEnvError(Env{{"RANK", ""}, {"WORLD_SIZE", "4"}}, {"RANK=''", "not an integer"});
  expectEnvError(Env{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, {"WORLD_SIZE='0'", "out of range"});
  expectEnvError(Env{{"RANK", "0"}, {"WORLD_SIZE", "99999999999999999999"}}, {"WORLD_SIZE='99999999999999999999'"});
  expectEnvError(Env{{"RANK", "0"}}, {"RANK='0' is set but WORLD_SIZE is not"});
  expectEnvError(Env{{"WORLD_SIZE", "2"}}, {"WORLD_SIZE='2' is set but RANK is not"});
  expectEnvError(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}},
                 {"LOCAL_RANK='2'", "out of range"});
  expectEnvError(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "70000"}},
                 {"MASTER_PORT='70000'", "[1, 65535]"});
  expectEnvError(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "0"}},
                 {"MASTER_PORT='0'"});
  expectEnvError(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "http"}},
                 {"MASTER_PORT='http'", "not an integer"});
  expectEnvError(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}},
                 {"missing master address", "MASTER_ADDR"});
  expectEnvError(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", ""}, {"MASTER_PORT", "1"}},
                 {"MASTER_ADDR is set but empty"});
  expectEnvError(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}}, {"missing master port", "MASTER_PORT"});
  expectEnvError(Env{{"DISTGRAD_RPC_TIMEOUT_MS", "0"}}, {"DISTGRAD_RPC_TIMEOUT_MS='0'", "out of range"});
  expectEnvError(Env{{"DISTGRAD_RPC_TIMEOUT_MS", "soon"}}, {"DISTGRAD_RPC_TIMEOUT_MS='soon'", "not an integer"});
  expectEnvError(Env{{"DISTGRAD_TRANSPORT", "carrier-pigeon"}}, {"DISTGRAD_TRANSPORT", "carrier-pigeon"});
  expectEnvError(Env{{"DISTGRAD_WORKER_NAME", ""}}, {"DISTGRAD_WORKER_NAME is set but empty"});
  expectEnvError(Env{{"DISTGRAD_TRACE", ""}}, {"DISTGRAD_TRACE is set but empty"});
  expectEnvError(Env{{"DISTGRAD_WORKER_NAME", "two words"}}, {"two words", "whitespace"});
  expectEnvError(Env{{"DISTGRAD_STORE", "nohost"}}, {"DISTGRAD_STORE='nohost'", "host:port"});
  expectEnvError(Env{{"DISTGRAD_STORE", "h:99999"}}, {"DISTGRAD_STORE='h:99999'", "invalid port"});
  expectEnvError(Env{{"DISTGRAD_STORE", "h:0"}}, {"DISTGRAD_STORE='h:0'", "port 0"});
  expectEnvError(Env{{"DISTGRAD_EXECUTOR_THREADS", "0"}}, {"DISTGRAD_EXECUTOR_THREADS='0'"});
  expectEnvError(Env{{"DISTGRAD_HEARTBEAT_INTERVAL_MS", "5000"}, {"DISTGRAD_HEARTBEAT_TIMEOUT_MS", "1000"}},
                 {"heartbeatTimeout", "heartbeatInterval"});
  expectEnvError(Env{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "node[01-"}},
                 {"SLURM_JOB_NODELIST='node[01-'", "matching ']'"});
}

TEST(Options, ExplicitValidate) {
  Options o;
  EXPECT_NO_THROW(o.validate());
  EXPECT_EQ(o.name(), "worker0");
  o.rank = 0;
  o.workerName = "ps";
  EXPECT_EQ(o.name(), "ps");
  o.worldSize = 2;
  o.rank = 2;
  EXPECT_THROW(o.validate(), ValueError);
  o.rank = 1;
  o.masterPort = -1;
  EXPECT_THROW(o.validate(), ValueError);
  o.masterPort = 10;
  o.defaultTimeout = std::chrono::milliseconds(-5);
  try {
    o.validate();
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("defaultTimeout must be > 0 ms, got -5"), std::string::npos) << e.what();
  }
}

TEST(SlurmNodelist, Expansion) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expandSlurmNodelist("node[01-04,07]"), (V{"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(expandSlurmNodelist("a1,b2"), (V{"a1", "b2"}));
  EXPECT_EQ(expandSlurmNodelist("gpu-[3-5]x"), (V{"gpu-3x", "gpu-4x", "gpu-5x"}));
  EXPECT_EQ(expandSlurmNodelist("single"), (V{"single"}));
  EXPECT_EQ(expandSlurmNodelist("n[8-11]"), (V{"n8", "n9", "n10", "n11"}));
  EXPECT_EQ(expandSlurmNodelist("n[098-101]"), (V{"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(expandSlurmNodelist("r[1-2]-n[01-02]"), (V{"r1-n01", "r1-n02", "r2-n01", "r2-n02"}));
  EXPECT_EQ(expandSlurmNodelist("a[1-2],b,c[5]"), (V{"a1", "a2", "b", "c5"}));
  EXPECT_EQ(expandSlurmNodelist("[1-2]"), (V{"1", "2"}));
}

TEST(SlurmNodelist, FirstHost) {
  EXPECT_EQ(firstSlurmHost("node[01-04,07]"), "node01");
  EXPECT_EQ(firstSlurmHost("a1,b2"), "a1");
  EXPECT_EQ(firstSlurmHost("gpu-[3-5]x"), "gpu-3x");
  EXPECT_EQ(firstSlurmHost("r[7-9]-n[003,1]"), "r7-n003");
  EXPECT_EQ(firstSlurmHost("big[0-999999999]"), "big0");  // never expanded
}

TEST(SlurmNodelist, Malformed) {
  for (const char* bad : {"", "node[01-04", "node]01[", "node[]", "node[4-1]", "node[a-b]", "a,,b", ",a", "a,",
                          "n[1-2,]", "n[[1]]", "n[1--2]", "two words"}) {
    try {
      expandSlurmNodelist(bad, "SLURM_NODELIST");
      ADD_FAILURE() << "expected an error for '" << bad << "'";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("SLURM_NODELIST='" + std::string(bad) + "'"), std::string::npos)
          << e.what();
    }
    EXPECT_THROW(firstSlurmHost(bad), ValueError) << bad;
  }
  EXPECT_THROW(expandSlurmNodelist("n[1-100]", "X", 50), ValueError);
}

TEST(HostPort, Parse) {
  EXPECT_EQ(parseHostPort("localhost:80", "x"), (std::pair<std::string, int>{"localhost", 80}));
  EXPECT_EQ(parseHostPort("[::1]:0", "x"), (std::pair<std::string, int>{"::1", 0}));
  EXPECT_THROW(parseHostPort(":80", "x"), ValueError);
  EXPECT_THROW(parseHostPort("::1:80", "x"), ValueError);
  EXPECT_THROW(parseHostPort("h:", "x"), ValueError);
  EXPECT_THROW(parseHostPort("[::1]80", "x"), ValueError);
  EXPECT_THROW(parseHostPort("h:65536", "x"), ValueError);
}

}  // namespace
}  // namespace distgrad::rpc
