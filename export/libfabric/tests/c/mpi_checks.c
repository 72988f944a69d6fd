/* MPI checks for Open MPI over weft-fi (pml cm, mtl ofi, FI_PROVIDER=weft): point-to-point
 * with data checks from 0 B to 4 MiB, wildcards, probes, matched probes, cancellation,
 * truncation, synchronous sends and collectives. Every check prints one line; the program
 * exits non-zero at the first failure (MPI_Abort), so a test sees which one. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, size;

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "[%d] FAILED %s:%d: ", rank, __FILE__, __LINE__);              \
            fprintf(stderr, __VA_ARGS__);                                                  \
            fprintf(stderr, "\n");                                                         \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                  \
        }                                                                                  \
    } while (0)

static void fill(unsigned char *b, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) b[i] = (unsigned char)(i * 131u + seed);
}

static size_t bad(const unsigned char *b, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++)
        if (b[i] != (unsigned char)(i * 131u + seed)) return i + 1;
    return 0;
}

static void done(const char *what) {
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) printf("ok %s\n", what);
    fflush(stdout);
}

/* Rank 0 and rank 1 ping-pong every size from 0 B to 4 MiB (powers of two and neighbours). */
static void pingpong(void) {
    size_t max = 4u << 20;
    unsigned char *s = malloc(max + 1), *r = malloc(max + 1);
    size_t sizes[64];
    int n = 0;
    sizes[n++] = 0;
    for (size_t k = 1; k <= max; k *= 2) {
        sizes[n++] = k;
        if (k > 2 && k < max) sizes[n++] = k + 1;
    }
    for (int i = 0; i < n && rank < 2; i++) {
        size_t len = sizes[i];
        int peer = 1 - rank;
        MPI_Status st;
        int count;
        if (rank == 0) {
            fill(s, len, (unsigned)i);
            MPI_Send(s, (int)len, MPI_BYTE, peer, i, MPI_COMM_WORLD);
            memset(r, 0, len);
            MPI_Recv(r, (int)len, MPI_BYTE, peer, i, MPI_COMM_WORLD, &st);
            MPI_Get_count(&st, MPI_BYTE, &count);
            CHECK((size_t)count == len, "pong of %zu bytes came back with %d", len, count);
            size_t at = bad(r, len, (unsigned)i + 1);
            CHECK(at == 0, "pong of %zu bytes differs at byte %zu", len, at - 1);
        } else {
            memset(r, 0, len);
            MPI_Recv(r, (int)len, MPI_BYTE, peer, i, MPI_COMM_WORLD, &st);
            MPI_Get_count(&st, MPI_BYTE, &count);
            CHECK((size_t)count == len && st.MPI_SOURCE == 0 && st.MPI_TAG == i,
                  "ping of %zu bytes: count %d source %d tag %d", len, count, st.MPI_SOURCE,
                  st.MPI_TAG);
            size_t at = bad(r, len, (unsigned)i);
            CHECK(at == 0, "ping of %zu bytes differs at byte %zu", len, at - 1);
            fill(s, len, (unsigned)i + 1);
            MPI_Send(s, (int)len, MPI_BYTE, peer, i, MPI_COMM_WORLD);
        }
    }
    free(s);
    free(r);
    done("pingpong 0 B - 4 MiB with data checks");
}

/* Every other rank sends to rank 0, which receives with MPI_ANY_SOURCE / MPI_ANY_TAG. */
static void wildcards(void) {
    if (rank == 0) {
        int seen = 0;
        for (int i = 1; i < size; i++) {
            int v;
            MPI_Status st;
            MPI_Recv(&v, 1, MPI_INT, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &st);
            CHECK(v == st.MPI_SOURCE * 1000 + st.MPI_TAG, "value %d from %d tag %d", v,
                  st.MPI_SOURCE, st.MPI_TAG);
            CHECK(!(seen & (1 << st.MPI_SOURCE)), "rank %d twice", st.MPI_SOURCE);
            seen |= 1 << st.MPI_SOURCE;
        }
        MPI_Barrier(MPI_COMM_WORLD);
        /* Any source, a given tag; then a given source, any tag. */
        for (int i = 1; i < size; i++) {
            int v;
            MPI_Status st;
            MPI_Recv(&v, 1, MPI_INT, MPI_ANY_SOURCE, 77, MPI_COMM_WORLD, &st);
            CHECK(st.MPI_TAG == 77 && v == -st.MPI_SOURCE, "tag 77: %d from %d", v,
                  st.MPI_SOURCE);
        }
        for (int i = 1; i < size; i++) {
            int v;
            MPI_Status st;
            MPI_Recv(&v, 1, MPI_INT, i, MPI_ANY_TAG, MPI_COMM_WORLD, &st);
            CHECK(st.MPI_SOURCE == i && v == i && st.MPI_TAG == 5 + i, "from %d: %d tag %d", i,
                  v, st.MPI_TAG);
        }
    } else {
        int v = rank * 1000 + rank % 7;
        MPI_Send(&v, 1, MPI_INT, 0, rank % 7, MPI_COMM_WORLD);
        /* The next messages only once rank 0 has the first of every rank (order across
         * senders is not MPI's to keep). */
        MPI_Barrier(MPI_COMM_WORLD);
        v = -rank;
        MPI_Send(&v, 1, MPI_INT, 0, 77, MPI_COMM_WORLD);
        v = rank;
        MPI_Send(&v, 1, MPI_INT, 0, 5 + rank, MPI_COMM_WORLD);
    }
    done("MPI_ANY_SOURCE and MPI_ANY_TAG");
}

/* Non-overtaking: messages from one sender with one tag arrive in order, small and large. */
static void ordering(void) {
    enum { N = 16 };
    if (rank == 1) {
        static unsigned char big[N][100000];
        MPI_Request rq[N];
        for (int i = 0; i < N; i++) {
            fill(big[i], sizeof big[i], (unsigned)i);
            int len = (i % 2) ? (int)sizeof big[i] : 16;
            MPI_Isend(big[i], len, MPI_BYTE, 0, 3, MPI_COMM_WORLD, &rq[i]);
        }
        MPI_Waitall(N, rq, MPI_STATUSES_IGNORE);
    } else if (rank == 0) {
        static unsigned char got[100000];
        for (int i = 0; i < N; i++) {
            MPI_Status st;
            int count;
            MPI_Recv(got, sizeof got, MPI_BYTE, 1, 3, MPI_COMM_WORLD, &st);
            MPI_Get_count(&st, MPI_BYTE, &count);
            CHECK(count == ((i % 2) ? (int)sizeof got : 16), "message %d has %d bytes", i, count);
            CHECK(bad(got, (size_t)count, (unsigned)i) == 0, "message %d out of order", i);
        }
    }
    done("non-overtaking order, small and large");
}

static void probes(void) {
    if (rank == 1) {
        int v[3] = {11, 22, 33};
        MPI_Send(v, 3, MPI_INT, 0, 9, MPI_COMM_WORLD);
        MPI_Send(v, 2, MPI_INT, 0, 10, MPI_COMM_WORLD);
        MPI_Send(v, 1, MPI_INT, 0, 11, MPI_COMM_WORLD);
    } else if (rank == 0) {
        MPI_Status st;
        int count, flag = 0, v[3];
        MPI_Probe(1, 9, MPI_COMM_WORLD, &st);
        MPI_Get_count(&st, MPI_INT, &count);
        CHECK(count == 3 && st.MPI_SOURCE == 1 && st.MPI_TAG == 9, "probe: %d ints", count);
        MPI_Recv(v, 3, MPI_INT, 1, 9, MPI_COMM_WORLD, &st);
        CHECK(v[2] == 33, "after probe: %d", v[2]);
        while (!flag) MPI_Iprobe(MPI_ANY_SOURCE, 10, MPI_COMM_WORLD, &flag, &st);
        MPI_Get_count(&st, MPI_INT, &count);
        CHECK(count == 2 && st.MPI_SOURCE == 1, "iprobe: %d ints from %d", count, st.MPI_SOURCE);
        MPI_Recv(v, 3, MPI_INT, 1, 10, MPI_COMM_WORLD, &st);
        /* Nothing with tag 12: iprobe says so. */
        MPI_Iprobe(1, 12, MPI_COMM_WORLD, &flag, &st);
        CHECK(!flag, "iprobe found a message never sent");
        MPI_Message m;
        MPI_Mprobe(1, MPI_ANY_TAG, MPI_COMM_WORLD, &m, &st);
        MPI_Get_count(&st, MPI_INT, &count);
        CHECK(count == 1 && st.MPI_TAG == 11, "mprobe: %d ints tag %d", count, st.MPI_TAG);
        /* The matched message is this caller's: a receive cannot take it any more. */
        MPI_Iprobe(1, 11, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
        CHECK(!flag, "a matched message was still visible to iprobe");
        v[0] = 0;
        MPI_Mrecv(v, 1, MPI_INT, &m, &st);
        CHECK(v[0] == 11 && m == MPI_MESSAGE_NULL, "mrecv: %d", v[0]);
    }
    done("MPI_Probe, MPI_Iprobe, MPI_Mprobe/MPI_Mrecv");
}

static void cancel(void) {
    int v;
    MPI_Request rq;
    MPI_Status st;
    int flag;
    MPI_Irecv(&v, 1, MPI_INT, MPI_ANY_SOURCE, 4242, MPI_COMM_WORLD, &rq);
    MPI_Cancel(&rq);
    MPI_Wait(&rq, &st);
    MPI_Test_cancelled(&st, &flag);
    CHECK(flag, "the receive was not cancelled");
    done("MPI_Cancel of a receive");
}

static void truncation(void) {
    if (rank == 1) {
        int v[8] = {0};
        MPI_Send(v, 8, MPI_INT, 0, 6, MPI_COMM_WORLD);
        static unsigned char big[1 << 20];
        MPI_Send(big, sizeof big, MPI_BYTE, 0, 7, MPI_COMM_WORLD);
    } else if (rank == 0) {
        MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
        int v[4], cls;
        MPI_Status st;
        int rc = MPI_Recv(v, 4, MPI_INT, 1, 6, MPI_COMM_WORLD, &st);
        MPI_Error_class(rc, &cls);
        CHECK(cls == MPI_ERR_TRUNCATE, "8 ints into 4: error class %d", cls);
        static unsigned char half[1 << 19];
        rc = MPI_Recv(half, sizeof half, MPI_BYTE, 1, 7, MPI_COMM_WORLD, &st);
        MPI_Error_class(rc, &cls);
        CHECK(cls == MPI_ERR_TRUNCATE, "1 MiB into 512 KiB: error class %d", cls);
        MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_ARE_FATAL);
    }
    done("truncation is MPI_ERR_TRUNCATE");
}

static void ssend(void) {
    if (rank == 1) {
        int v = 5;
        MPI_Ssend(&v, 1, MPI_INT, 0, 8, MPI_COMM_WORLD);
        static unsigned char big[200000];
        fill(big, sizeof big, 3);
        MPI_Ssend(big, sizeof big, MPI_BYTE, 0, 8, MPI_COMM_WORLD);
    } else if (rank == 0) {
        int v = 0;
        MPI_Recv(&v, 1, MPI_INT, 1, 8, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        CHECK(v == 5, "ssend value %d", v);
        static unsigned char big[200000];
        MPI_Recv(big, sizeof big, MPI_BYTE, 1, 8, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        CHECK(bad(big, sizeof big, 3) == 0, "ssend of 200000 bytes differs");
    }
    done("MPI_Ssend");
}

static void collectives(void) {
    int v = rank + 1, sum = 0;
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Allreduce(&v, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    CHECK(sum == size * (size + 1) / 2, "allreduce %d", sum);
    static double b[1 << 17];
    if (rank == 0)
        for (int i = 0; i < (1 << 17); i++) b[i] = i * 0.5;
    MPI_Bcast(b, 1 << 17, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    for (int i = 0; i < (1 << 17); i++) CHECK(b[i] == i * 0.5, "bcast element %d", i);
    int *out = malloc(sizeof(int) * size * 1024), *in = malloc(sizeof(int) * size * 1024);
    for (int p = 0; p < size; p++)
        for (int k = 0; k < 1024; k++) out[p * 1024 + k] = rank * 100000 + p * 1024 + k;
    MPI_Alltoall(out, 1024, MPI_INT, in, 1024, MPI_INT, MPI_COMM_WORLD);
    for (int p = 0; p < size; p++)
        for (int k = 0; k < 1024; k++)
            CHECK(in[p * 1024 + k] == p * 100000 + rank * 1024 + k, "alltoall from %d", p);
    free(out);
    free(in);
    done("barrier, bcast, allreduce, alltoall");
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const char *only = argc > 1 ? argv[1] : "all";
    int all = strcmp(only, "all") == 0;
    if (all || !strcmp(only, "pingpong")) pingpong();
    if (all || !strcmp(only, "wildcards")) wildcards();
    if (all || !strcmp(only, "ordering")) ordering();
    if (all || !strcmp(only, "probes")) probes();
    if (all || !strcmp(only, "cancel")) cancel();
    if (all || !strcmp(only, "truncation")) truncation();
    if (all || !strcmp(only, "ssend")) ssend();
    if (all || !strcmp(only, "collectives")) collectives();
    if (rank == 0) printf("all passed at %d ranks\n", size);
    MPI_Finalize();
    return 0;
}
