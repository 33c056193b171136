// Why: bench/netns_link.sh needs a program whose traffic across the
// simulated link is known to the byte, so that the veth counters and the
// configured tbf rate can be checked against it. It is deliberately plain
// MPI (no zero headers): it checks the harness, not the library.
//
// Layout expected: 4 ranks, "2 nodes of 2": ranks 0,1 in namespace
// zero-node0 and ranks 2,3 in zero-node1. The program checks that layout
// through MPI_COMM_TYPE_SHARED (what a hierarchical algorithm would use to
// find its node), then:
//   1. intra-node: 0<->1 and 2<->3 exchange N bytes each way at the same time
//      (should be shared memory: fast, and nothing on the veth);
//   2. inter-node, one way: 0 -> 2, then 2 -> 0 (N bytes each);
//   3. inter-node, both ways at once: 0 <-> 2 (N bytes each way).
// Idle ranks wait in a sleeping poll, not a busy one: on a small machine the
// four ranks share few cores, and a spinning idle rank would steal the CPU
// that the TCP transfer needs.
//
// Output (rank 0, one line each, key=value, parsed by netns_link.sh):
//   PINGPONG nodes=2 node_sizes=2,2 ...
//   PINGPONG_RESULT inter_bytes=<payload bytes the program sent across nodes>
//     intra_bytes=... oneway_MBps=... reverse_MBps=... bidir_MBps=... intra_MBps=...
//   (MBps: 10^6 bytes per second of payload, per direction.)
//
//   mpicxx -O2 -std=c++20 bench/netns_pingpong.cpp -o pingpong
//   pingpong [MiB=64]
#define OMPI_SKIP_MPICXX 1  // C API only (the C++ bindings warn under -Wextra)
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

// Wait for a request without spinning the CPU.
void sleepy_wait(MPI_Request& req) {
    for (int done = 0;;) {
        MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (done) return;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
}

void sleepy_barrier(MPI_Comm comm) {
    MPI_Request req;
    MPI_Ibarrier(comm, &req);
    sleepy_wait(req);
}

// Large messages are sent in pieces below INT_MAX elements; MPI counts are int.
constexpr std::size_t kChunk = std::size_t{1} << 30;

void send_bytes(const unsigned char* p, std::size_t n, int peer, MPI_Comm comm) {
    for (std::size_t off = 0; off < n; off += kChunk) {
        const int len = static_cast<int>(std::min(kChunk, n - off));
        MPI_Send(p + off, len, MPI_BYTE, peer, 7, comm);
    }
}

void recv_bytes(unsigned char* p, std::size_t n, int peer, MPI_Comm comm) {
    for (std::size_t off = 0; off < n; off += kChunk) {
        const int len = static_cast<int>(std::min(kChunk, n - off));
        MPI_Recv(p + off, len, MPI_BYTE, peer, 7, comm, MPI_STATUS_IGNORE);
    }
}

void exchange_bytes(const unsigned char* s, unsigned char* r, std::size_t n, int peer,
                    MPI_Comm comm) {
    for (std::size_t off = 0; off < n; off += kChunk) {
        const int len = static_cast<int>(std::min(kChunk, n - off));
        MPI_Sendrecv(s + off, len, MPI_BYTE, peer, 8, r + off, len, MPI_BYTE, peer, 8, comm,
                     MPI_STATUS_IGNORE);
    }
}

std::uint64_t checksum(const unsigned char* p, std::size_t n) {
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a, 8 bytes at a time
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        std::uint64_t w;
        std::memcpy(&w, p + i, 8);
        h = (h ^ w) * 1099511628211ull;
    }
    for (; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

void fill(unsigned char* p, std::size_t n, int seed) {
    std::uint64_t x = 0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(seed + 1);
    for (std::size_t i = 0; i < n; ++i) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[i] = static_cast<unsigned char>(x);
    }
}

}  // namespace

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    int rank = 0, size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const double mib = argc > 1 ? std::atof(argv[1]) : 64.0;
    const auto n = static_cast<std::size_t>(mib * 1024 * 1024);

    if (size != 4) {
        if (rank == 0) std::fprintf(stderr, "netns_pingpong: needs 4 ranks (2 nodes of 2), got %d\n", size);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }

    // The node layout as MPI sees it.
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    int node_size = 0;
    MPI_Comm_size(node, &node_size);
    int node_leader = rank;  // lowest world rank on my node
    MPI_Allreduce(MPI_IN_PLACE, &node_leader, 1, MPI_INT, MPI_MIN, node);
    std::vector<int> leaders(size), sizes(size);
    MPI_Gather(&node_leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_Gather(&node_size, 1, MPI_INT, sizes.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
    char host[MPI_MAX_PROCESSOR_NAME] = {};
    int host_len = 0;
    MPI_Get_processor_name(host, &host_len);
    std::vector<char> hosts(static_cast<std::size_t>(size) * MPI_MAX_PROCESSOR_NAME);
    MPI_Gather(host, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, hosts.data(), MPI_MAX_PROCESSOR_NAME,
               MPI_CHAR, 0, MPI_COMM_WORLD);
    int layout_ok = 1;
    if (rank == 0) {
        layout_ok = leaders[0] == 0 && leaders[1] == 0 && leaders[2] == 2 && leaders[3] == 2 &&
                    sizes[0] == 2 && sizes[2] == 2;
        std::printf("PINGPONG layout=%s shared_leaders=%d,%d,%d,%d hosts=", layout_ok ? "ok" : "WRONG",
                    leaders[0], leaders[1], leaders[2], leaders[3]);
        for (int r = 0; r < size; ++r)
            std::printf("%s%s", r ? "," : "", &hosts[static_cast<std::size_t>(r) * MPI_MAX_PROCESSOR_NAME]);
        std::printf(" MiB=%g\n", mib);
        std::fflush(stdout);
    }
    MPI_Bcast(&layout_ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (!layout_ok) {
        if (rank == 0)
            std::fprintf(stderr, "netns_pingpong: MPI does not see 2 nodes of 2 (ranks 0,1 | 2,3)\n");
        MPI_Abort(MPI_COMM_WORLD, 3);
    }

    std::vector<unsigned char> sbuf(n), rbuf(n);
    fill(sbuf.data(), n, rank);
    const int intra_peer = rank ^ 1;  // 0<->1, 2<->3
    const int inter_peer = rank ^ 2;  // 0<->2, 1<->3 (only 0 and 2 talk)
    bool bad = false;
    auto expect = [&](int from) {
        std::vector<unsigned char> want(n);
        fill(want.data(), n, from);
        if (checksum(rbuf.data(), n) != checksum(want.data(), n)) {
            std::fprintf(stderr, "netns_pingpong: rank %d got corrupt data from %d\n", rank, from);
            bad = true;
        }
    };
    std::uint64_t inter_bytes = 0, intra_bytes = 0;  // payload sent, counted on rank 0's view

    // Warm-up: open the connections (Open MPI's TCP BTL connects lazily) so
    // that no phase pays for the handshakes.
    {
        unsigned char a = 1, b = 0;
        MPI_Sendrecv(&a, 1, MPI_BYTE, intra_peer, 1, &b, 1, MPI_BYTE, intra_peer, 1, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
        if (rank == 0 || rank == 2)
            MPI_Sendrecv(&a, 1, MPI_BYTE, inter_peer, 1, &b, 1, MPI_BYTE, inter_peer, 1,
                         MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        inter_bytes += 2;
        intra_bytes += 4;
    }

    // 1. intra-node exchange, both nodes at once.
    sleepy_barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    exchange_bytes(sbuf.data(), rbuf.data(), n, intra_peer, MPI_COMM_WORLD);
    double t_intra = MPI_Wtime() - t0;
    expect(intra_peer);
    intra_bytes += 4 * n;

    // 2. one way across the link, timed by the sender up to a 1-byte reply
    // (the reply adds one round trip, microseconds here).
    auto one_way = [&](int from, int to) -> double {
        sleepy_barrier(MPI_COMM_WORLD);
        double t = 0;
        unsigned char ack = 0;
        if (rank == from) {
            t = MPI_Wtime();
            send_bytes(sbuf.data(), n, to, MPI_COMM_WORLD);
            MPI_Recv(&ack, 1, MPI_BYTE, to, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            t = MPI_Wtime() - t;
        } else if (rank == to) {
            recv_bytes(rbuf.data(), n, from, MPI_COMM_WORLD);
            MPI_Send(&ack, 1, MPI_BYTE, from, 9, MPI_COMM_WORLD);
            expect(from);
        }
        inter_bytes += n + 1;
        MPI_Bcast(&t, 1, MPI_DOUBLE, from, MPI_COMM_WORLD);
        return t;
    };
    const double t_fwd = one_way(0, 2);
    const double t_rev = one_way(2, 0);

    // 3. both ways at once.
    sleepy_barrier(MPI_COMM_WORLD);
    double t_bi = 0;
    if (rank == 0 || rank == 2) {
        t0 = MPI_Wtime();
        exchange_bytes(sbuf.data(), rbuf.data(), n, inter_peer, MPI_COMM_WORLD);
        t_bi = MPI_Wtime() - t0;
        expect(inter_peer);
    }
    MPI_Bcast(&t_bi, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    inter_bytes += 2 * n;

    int any_bad = bad ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0) {
        auto mbps = [&](double t) { return t > 0 ? static_cast<double>(n) / t / 1e6 : 0.0; };
        std::printf(
            "PINGPONG_RESULT inter_bytes=%llu intra_bytes=%llu oneway_MBps=%.1f reverse_MBps=%.1f "
            "bidir_MBps=%.1f intra_MBps=%.1f oneway_s=%.3f reverse_s=%.3f bidir_s=%.3f data=%s\n",
            static_cast<unsigned long long>(inter_bytes), static_cast<unsigned long long>(intra_bytes),
            mbps(t_fwd), mbps(t_rev), mbps(t_bi), mbps(t_intra), t_fwd, t_rev, t_bi,
            any_bad ? "CORRUPT" : "ok");
        std::fflush(stdout);
    }
    MPI_Comm_free(&node);
    MPI_Finalize();
    return any_bad ? 4 : 0;
}
