/* One-sided MPI checks for Open MPI over weft-fi (osc/rdma over btl/ofi, which asks weft-fi
 * for FI_RMA and FI_ATOMIC): puts and gets of 8 B to 4 MiB with data checks under fence,
 * accumulate, fetch-and-op and compare-and-swap under passive-target locks, PSCW,
 * get-accumulate, on windows allocated by MPI and created over the program's memory.
 * Prints "rma passed at N ranks" when every check holds; exits non-zero at the first that
 * does not. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, size;

#define CHECK(c, ...)                                                  \
    do {                                                               \
        if (!(c)) {                                                    \
            fprintf(stderr, "rank %d: check failed: %s: ", rank, #c);  \
            fprintf(stderr, __VA_ARGS__);                              \
            fprintf(stderr, "\n");                                     \
            MPI_Abort(MPI_COMM_WORLD, 1);                              \
        }                                                              \
    } while (0)

static unsigned char pattern(int from, size_t i) { return (unsigned char)(from * 31 + i * 7 + 1); }

/* Puts of `len` bytes into the right neighbour and gets from the left, under fence. */
static void put_get(size_t len, int create) {
    int right = (rank + 1) % size, left = (rank + size - 1) % size;
    unsigned char *base, *src = malloc(len), *dst = malloc(len);
    MPI_Win win;
    if (create) {
        base = malloc(len);
        MPI_Win_create(base, len, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &win);
    } else {
        MPI_Win_allocate(len, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
    }
    memset(base, 0, len);
    for (size_t i = 0; i < len; i++) src[i] = pattern(rank, i);
    MPI_Win_fence(0, win);
    MPI_Put(src, len, MPI_BYTE, right, 0, len, MPI_BYTE, win);
    MPI_Win_fence(0, win);
    for (size_t i = 0; i < len; i++)
        CHECK(base[i] == pattern(left, i), "put of %zu bytes, byte %zu", len, i);
    memset(dst, 0, len);
    MPI_Get(dst, len, MPI_BYTE, left, 0, len, MPI_BYTE, win);
    MPI_Win_fence(0, win);
    /* The left neighbour's window holds what its own left neighbour put. */
    int ll = (left + size - 1) % size;
    for (size_t i = 0; i < len; i++)
        CHECK(dst[i] == pattern(ll, i), "get of %zu bytes, byte %zu", len, i);
    MPI_Win_free(&win);
    if (create) free(base);
    free(src);
    free(dst);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);

    for (size_t len = 8; len <= (4u << 20); len *= 8) put_get(len, 0);
    put_get(1u << 20, 1);
    put_get(4u << 20, 1);

    /* Accumulate: every rank adds rank+1 to each element of rank 0's window. */
    {
        long *base;
        long mine[16];
        MPI_Win win;
        MPI_Win_allocate(sizeof mine, sizeof(long), MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
        for (int i = 0; i < 16; i++) { base[i] = 0; mine[i] = rank + 1; }
        MPI_Win_fence(0, win);
        MPI_Accumulate(mine, 16, MPI_LONG, 0, 0, 16, MPI_LONG, MPI_SUM, win);
        MPI_Win_fence(0, win);
        if (rank == 0)
            for (int i = 0; i < 16; i++)
                CHECK(base[i] == (long)size * (size + 1) / 2, "accumulate [%d] = %ld", i, base[i]);
        MPI_Win_free(&win);
    }

    /* Fetch-and-op under lock_all: a shared counter at rank 0; the fetched values are all
     * different and the total is right. */
    {
        long *base, one = 1, got;
        const int n = 200;
        MPI_Win win;
        MPI_Win_allocate(sizeof(long), sizeof(long), MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
        *base = 0;
        MPI_Barrier(MPI_COMM_WORLD);
        long *seen = calloc(n, sizeof(long));
        MPI_Win_lock_all(0, win);
        for (int i = 0; i < n; i++) {
            MPI_Fetch_and_op(&one, &got, MPI_LONG, 0, 0, MPI_SUM, win);
            MPI_Win_flush(0, win);
            seen[i] = got;
            CHECK(got >= 0 && got < (long)n * size, "fetched %ld", got);
            if (i > 0) CHECK(got > seen[i - 1], "fetched values grow: %ld after %ld", got, seen[i - 1]);
        }
        MPI_Win_unlock_all(win);
        MPI_Barrier(MPI_COMM_WORLD);
        MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
        long total;
        MPI_Get(&total, 1, MPI_LONG, 0, 0, 1, MPI_LONG, win);
        MPI_Win_unlock(0, win);
        CHECK(total == (long)n * size, "counter %ld, not %ld", total, (long)n * size);
        free(seen);
        MPI_Win_free(&win);
    }

    /* Compare-and-swap: exactly one rank swaps -1 for its rank. */
    {
        int *base, mine = rank, cmp = -1, old;
        MPI_Win win;
        MPI_Win_allocate(sizeof(int), sizeof(int), MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
        *base = -1;
        MPI_Barrier(MPI_COMM_WORLD);
        MPI_Win_lock(MPI_LOCK_EXCLUSIVE, 0, 0, win);
        MPI_Compare_and_swap(&mine, &cmp, &old, MPI_INT, 0, 0, win);
        MPI_Win_unlock(0, win);
        int won = old == -1, winners;
        MPI_Allreduce(&won, &winners, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        CHECK(winners == 1, "%d ranks swapped", winners);
        MPI_Win_free(&win);
    }

    /* Exclusive locks: each rank in turn adds to rank 0's value by get, modify, put. */
    {
        long *base;
        MPI_Win win;
        MPI_Win_allocate(sizeof(long), sizeof(long), MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
        *base = 0;
        MPI_Barrier(MPI_COMM_WORLD);
        for (int i = 0; i < 20; i++) {
            long v;
            MPI_Win_lock(MPI_LOCK_EXCLUSIVE, 0, 0, win);
            MPI_Get(&v, 1, MPI_LONG, 0, 0, 1, MPI_LONG, win);
            MPI_Win_flush(0, win);
            v += 1;
            MPI_Put(&v, 1, MPI_LONG, 0, 0, 1, MPI_LONG, win);
            MPI_Win_unlock(0, win);
        }
        MPI_Barrier(MPI_COMM_WORLD);
        if (rank == 0) {
            MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
            long v = *base;
            MPI_Win_unlock(0, win);
            CHECK(v == 20L * size, "locked increments: %ld, not %ld", v, 20L * size);
        }
        MPI_Win_free(&win);
    }

    /* PSCW: rank r exposes to r-1 and accesses r+1. */
    {
        int *base, right = (rank + 1) % size, left = (rank + size - 1) % size;
        MPI_Win win;
        MPI_Group world, to, from;
        MPI_Comm_group(MPI_COMM_WORLD, &world);
        MPI_Group_incl(world, 1, &right, &to);
        MPI_Group_incl(world, 1, &left, &from);
        MPI_Win_allocate(64 * sizeof(int), sizeof(int), MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
        for (int i = 0; i < 64; i++) base[i] = -1;
        int v[64];
        for (int i = 0; i < 64; i++) v[i] = rank * 1000 + i;
        MPI_Barrier(MPI_COMM_WORLD);
        MPI_Win_post(from, 0, win);
        MPI_Win_start(to, 0, win);
        MPI_Put(v, 64, MPI_INT, right, 0, 64, MPI_INT, win);
        MPI_Win_complete(win);
        MPI_Win_wait(win);
        for (int i = 0; i < 64; i++)
            CHECK(base[i] == left * 1000 + i, "PSCW [%d] = %d", i, base[i]);
        MPI_Group_free(&to);
        MPI_Group_free(&from);
        MPI_Group_free(&world);
        MPI_Win_free(&win);
    }

    /* Get-accumulate with MPI_REPLACE: a swap, the old value back. */
    {
        int *base, mine = rank + 100, old = -5;
        MPI_Win win;
        MPI_Win_allocate(sizeof(int) * size, sizeof(int), MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
        for (int i = 0; i < size; i++) base[i] = i;
        MPI_Win_fence(0, win);
        MPI_Get_accumulate(&mine, 1, MPI_INT, &old, 1, MPI_INT, 0, rank, 1, MPI_INT, MPI_REPLACE, win);
        MPI_Win_fence(0, win);
        CHECK(old == rank, "get-accumulate returned %d", old);
        if (rank == 0)
            for (int i = 0; i < size; i++) CHECK(base[i] == i + 100, "replaced [%d] = %d", i, base[i]);
        MPI_Win_free(&win);
    }

    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) printf("rma passed at %d ranks\n", size);
    MPI_Finalize();
    return 0;
}
