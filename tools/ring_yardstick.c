/*
 * The two-copy yardstick for shm's large-message ping-pong (docs/benchmarks.md, "shm against
 * its peers"): two processes pinned to CPUs 0 and 1, one ring per direction in shared memory
 * (NCH chunks of CHUNK bytes, a head and a tail counter), the sender memcpy's each chunk in, the
 * receiver memcpy's it out. No matching, no headers, no flow-control protocol beyond the
 * counters: what two copies cost on this machine.
 *
 *   gcc -O2 -o /tmp/ring_yardstick tools/ring_yardstick.c
 *   /tmp/ring_yardstick SIZE CHUNK NCH ITERS [one]
 *
 * "one" sends from the buffer it received into (NetPIPE's convention, `weft bench --one-buffer`);
 * otherwise a separate send buffer. Prints the one-way time of the second of two timed rounds.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    _Atomic unsigned long head;
    char pad[56];
    _Atomic unsigned long tail;
    char pad2[56];
} ctl_t;

static size_t chunk, nch;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void send_msg(ctl_t *c, char *ring, const char *src, size_t n) {
    for (size_t off = 0; off < n;) {
        unsigned long h = atomic_load_explicit(&c->head, memory_order_relaxed);
        while (h - atomic_load_explicit(&c->tail, memory_order_acquire) >= nch)
            ;
        size_t k = n - off < chunk ? n - off : chunk;
        memcpy(ring + (h % nch) * chunk, src + off, k);
        atomic_store_explicit(&c->head, h + 1, memory_order_release);
        off += k;
    }
}

static void recv_msg(ctl_t *c, char *ring, char *dst, size_t n) {
    for (size_t off = 0; off < n;) {
        unsigned long t = atomic_load_explicit(&c->tail, memory_order_relaxed);
        while (atomic_load_explicit(&c->head, memory_order_acquire) == t)
            ;
        size_t k = n - off < chunk ? n - off : chunk;
        memcpy(dst + off, ring + (t % nch) * chunk, k);
        atomic_store_explicit(&c->tail, t + 1, memory_order_release);
        off += k;
    }
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s SIZE CHUNK NCH ITERS [one]\n", argv[0]);
        return 2;
    }
    size_t n = strtoull(argv[1], 0, 0);
    chunk = strtoull(argv[2], 0, 0);
    nch = strtoull(argv[3], 0, 0);
    int iters = atoi(argv[4]);
    int one = argc > 5 && strcmp(argv[5], "one") == 0;
    if (!n || !chunk || !nch || iters < 1) {
        fprintf(stderr, "SIZE, CHUNK, NCH and ITERS must be positive\n");
        return 2;
    }
    size_t rs = chunk * nch;
    char *m = mmap(0, 2 * sizeof(ctl_t) + 2 * rs, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    ctl_t *c0 = (ctl_t *)m, *c1 = c0 + 1;
    char *r0 = m + 2 * sizeof(ctl_t), *r1 = r0 + rs;
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return 1;
    }
    cpu_set_t cs;
    CPU_ZERO(&cs);
    CPU_SET(pid ? 0 : 1, &cs);
    sched_setaffinity(0, sizeof cs, &cs);
    char *d = malloc(n), *s = one ? d : malloc(n);
    if (!d || !s) {
        perror("malloc");
        return 1;
    }
    memset(s, 1, n);
    memset(d, 0, n);
    for (int round = 0; round < 2; round++) {
        double t0 = now();
        for (int i = 0; i < iters; i++) {
            if (pid) {
                send_msg(c0, r0, s, n);
                recv_msg(c1, r1, d, n);
            } else {
                recv_msg(c0, r0, d, n);
                send_msg(c1, r1, s, n);
            }
        }
        double t = (now() - t0) / iters / 2;
        if (pid && round == 1)
            printf("size %zu chunk %zu x %zu %s: one-way %.0f us, %.2f GB/s\n", n, chunk, nch,
                   one ? "one buffer" : "two buffers", t * 1e6, n / t / 1e9);
    }
    if (pid)
        wait(0);
    return 0;
}
