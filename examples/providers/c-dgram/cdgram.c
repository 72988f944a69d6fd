/* cdgram: a minimal weft provider in C, active messages only, over abstract-namespace UNIX
 * datagram sockets (one per rank, named from the job id and the rank). It uses nothing but the
 * generated header, abi/include/weft_provider.h.
 *
 * ABI 1.1 (the default build) connects lazily: each rank publishes its socket name in the
 * job's key-value space at open, and looks a peer's up only when weft calls `connect` for it
 * (WEFT_CAP_LAZY_CONNECT, WeftBoot::kv_*, WeftExtOps::connect, WeftSink::connection).
 * Built with -DCDGRAM_ABI_1_0 it is an ABI 1.0 library (every address computed at open),
 * which a 1.1 weft still loads.
 *
 * Build:   cc -shared -fPIC -O2 -I abi/include -o libweft-cdgram.so cdgram.c
 * Use:     WEFT_PROVIDER_PATH=$PWD WEFT_PROVIDER=cdgram weft run -n 4 -- ./app
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include "weft_provider.h"

#define MAX_HEADER 64
#define MAX_PAYLOAD 8192
#define PREFIX 6 /* source rank (u32) + header length (u16), little endian */
#define MAX_IOV 8

#ifndef CDGRAM_NAME
#define CDGRAM_NAME "cdgram"
#endif
#ifdef CDGRAM_ABI_1_0
#define CDGRAM_ABI ((1u << 16) | 0u)
#else
#define CDGRAM_ABI WEFT_ABI_VERSION
#endif

typedef struct {
    struct sockaddr_un addr;
    socklen_t len;
} peer_t;

typedef struct {
    int fd;
    uint32_t rank, size;
    peer_t *peers;
    unsigned char *buf;
    /* Messages to oneself, delivered by progress (a small FIFO of heap copies). */
    unsigned char **selfq;
    size_t *selflen;
    size_t self_head, self_tail, self_cap;
    /* ABI 1.1: which peers are connected (address looked up), and connections to report. */
    unsigned char *connected;
    uint32_t *events;
    size_t nevents;
    void *kv_ctx;
    int32_t (*kv_get)(void *, const char *, char *, size_t, size_t *);
    char job[128];
    char err[256];
} prov_t;

static __thread char last_err[256];

static void set_err(prov_t *p, const char *what) {
    char *dst = p ? p->err : last_err;
    snprintf(dst, 256, "cdgram: %s: %s", what, strerror(errno));
}

static void address(const char *job, uint32_t rank, peer_t *out) {
    memset(&out->addr, 0, sizeof out->addr);
    out->addr.sun_family = AF_UNIX;
    int n = snprintf(out->addr.sun_path + 1, sizeof out->addr.sun_path - 1, "weft-cdgram-%s-%u", job, rank);
    if (n < 0) n = 0;
    if ((size_t)n > sizeof out->addr.sun_path - 1) n = sizeof out->addr.sun_path - 1;
    out->len = (socklen_t)(sizeof(sa_family_t) + 1 + (size_t)n);
}

static int32_t probe(const WeftProbeCtx *ctx, char *why, size_t why_len) {
    if (ctx->hosts > 1) {
        snprintf(why, why_len, "UNIX sockets reach only ranks on one host");
        return WEFT_EUNAVAIL;
    }
    return WEFT_OK;
}

static int32_t caps(WeftCaps *c) {
    uint32_t size = c->size;
#ifdef CDGRAM_ABI_1_0
    memset(c, 0, offsetof(WeftCaps, reserved2)); /* what a 1.0 build's struct covers */
#else
    memset(c, 0, sizeof *c);
#endif
    c->size = size;
    c->max_am_header = MAX_HEADER;
    c->max_am_payload = MAX_PAYLOAD;
    c->eager_limit = MAX_PAYLOAD;
    c->max_iov = MAX_IOV - 2;
    c->flags = WEFT_CAP_SPANS_PROCESSES;
#ifndef CDGRAM_ABI_1_0
    c->flags |= WEFT_CAP_LAZY_CONNECT;
#endif
    return WEFT_OK;
}

static int32_t open_(const WeftBoot *b, void **out) {
    prov_t *p = calloc(1, sizeof *p);
    if (!p) return WEFT_EFAIL;
    p->rank = b->rank;
    p->size = b->nranks;
    p->fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    p->peers = calloc(b->nranks, sizeof(peer_t));
    p->buf = malloc(PREFIX + MAX_HEADER + MAX_PAYLOAD);
    p->self_cap = 64;
    p->selfq = calloc(p->self_cap, sizeof *p->selfq);
    p->selflen = calloc(p->self_cap, sizeof *p->selflen);
    p->connected = calloc(b->nranks, 1);
    p->events = calloc(b->nranks, sizeof *p->events);
    if (p->fd < 0 || !p->peers || !p->buf || !p->selfq || !p->selflen || !p->connected || !p->events) {
        set_err(NULL, "setup");
        goto fail;
    }
    snprintf(p->job, sizeof p->job, "%s", b->job_id);
    address(b->job_id, p->rank, &p->peers[p->rank]);
    p->connected[p->rank] = 1;
    if (bind(p->fd, (struct sockaddr *)&p->peers[p->rank].addr, p->peers[p->rank].len) != 0) {
        set_err(NULL, "bind");
        goto fail;
    }
#ifndef CDGRAM_ABI_1_0
    if (b->kv_ctx && b->kv_put && b->kv_get) {
        /* Publish our socket name; peers look it up when they first talk to us. */
        char key[64];
        snprintf(key, sizeof key, "cdgram.addr.%u", p->rank);
        if (b->kv_put(b->kv_ctx, key, p->peers[p->rank].addr.sun_path + 1) != WEFT_OK) {
            snprintf(last_err, sizeof last_err, "cdgram: key-value put failed");
            goto fail;
        }
        p->kv_ctx = b->kv_ctx;
        p->kv_get = b->kv_get;
    }
#endif
    if (!p->kv_ctx) {
        /* ABI 1.0 (or no key-value space): every address is computable now. */
        for (uint32_t r = 0; r < b->nranks; r++) {
            address(b->job_id, r, &p->peers[r]);
            p->connected[r] = 1;
        }
    }
    /* Everyone is bound before anyone sends. */
    if (b->fence(b->ctx) != WEFT_OK) {
        snprintf(last_err, sizeof last_err, "cdgram: bootstrap fence failed");
        goto fail;
    }
    *out = p;
    return WEFT_OK;
fail:
    if (p->fd >= 0) close(p->fd);
    free(p->peers);
    free(p->buf);
    free(p->selfq);
    free(p->selflen);
    free(p->connected);
    free(p->events);
    free(p);
    return WEFT_EFAIL;
}

static int32_t close_(void *h) {
    prov_t *p = h;
    close(p->fd);
    while (p->self_head != p->self_tail) {
        free(p->selfq[p->self_head % p->self_cap]);
        p->self_head++;
    }
    free(p->peers);
    free(p->buf);
    free(p->selfq);
    free(p->selflen);
    free(p->connected);
    free(p->events);
    free(p);
    return WEFT_OK;
}

#ifndef CDGRAM_ABI_1_0
/* ABI 1.1: look the peer's socket name up, and report the connection from progress. */
static int32_t connect_(void *h, uint32_t peer) {
    prov_t *p = h;
    if (peer >= p->size) {
        snprintf(p->err, sizeof p->err, "cdgram: connect to rank %u of %u", peer, p->size);
        return WEFT_EINVAL;
    }
    if (p->connected[peer]) return WEFT_OK;
    char key[64], name[108];
    size_t need = 0;
    snprintf(key, sizeof key, "cdgram.addr.%u", peer);
    if (p->kv_get(p->kv_ctx, key, name, sizeof name, &need) != WEFT_OK || need == 0) {
        snprintf(p->err, sizeof p->err, "cdgram: rank %u published no address", peer);
        return WEFT_EFAIL;
    }
    peer_t *pe = &p->peers[peer];
    memset(&pe->addr, 0, sizeof pe->addr);
    pe->addr.sun_family = AF_UNIX;
    size_t n = strlen(name);
    if (n > sizeof pe->addr.sun_path - 1) n = sizeof pe->addr.sun_path - 1;
    memcpy(pe->addr.sun_path + 1, name, n);
    pe->len = (socklen_t)(sizeof(sa_family_t) + 1 + n);
    p->connected[peer] = 1;
    p->events[p->nevents++] = peer;
    return WEFT_OK;
}
#endif

static int32_t am_send(void *h, uint32_t dest, const uint8_t *hdr, size_t hdr_len, const WeftIov *iov, size_t n) {
    prov_t *p = h;
    if (dest >= p->size || hdr_len > MAX_HEADER || n > MAX_IOV - 2) {
        errno = EINVAL;
        set_err(p, "bad destination, header or iovec");
        return WEFT_EINVAL;
    }
    if (!p->connected[dest]) {
        snprintf(p->err, sizeof p->err, "cdgram: send to rank %u before connect", dest);
        return WEFT_EINVAL;
    }
    unsigned char prefix[PREFIX];
    memcpy(prefix, &p->rank, 4);
    uint16_t hl = (uint16_t)hdr_len;
    memcpy(prefix + 4, &hl, 2);
    if (dest == p->rank) {
        if (p->self_tail - p->self_head == p->self_cap) return WEFT_BUSY;
        size_t total = PREFIX + hdr_len;
        for (size_t i = 0; i < n; i++) total += iov[i].len;
        unsigned char *m = malloc(total), *at = m;
        if (!m) return WEFT_EFAIL;
        memcpy(at, prefix, PREFIX); at += PREFIX;
        memcpy(at, hdr, hdr_len); at += hdr_len;
        for (size_t i = 0; i < n; i++) { memcpy(at, iov[i].base, iov[i].len); at += iov[i].len; }
        p->selfq[p->self_tail % p->self_cap] = m;
        p->selflen[p->self_tail % p->self_cap] = total;
        p->self_tail++;
        return WEFT_OK;
    }
    struct iovec v[MAX_IOV];
    v[0].iov_base = prefix;
    v[0].iov_len = PREFIX;
    v[1].iov_base = (void *)hdr;
    v[1].iov_len = hdr_len;
    for (size_t i = 0; i < n; i++) {
        v[2 + i].iov_base = (void *)iov[i].base;
        v[2 + i].iov_len = iov[i].len;
    }
    struct msghdr msg = {0};
    msg.msg_name = &p->peers[dest].addr;
    msg.msg_namelen = p->peers[dest].len;
    msg.msg_iov = v;
    msg.msg_iovlen = 2 + n;
    if (sendmsg(p->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL) >= 0) return WEFT_OK;
    if (errno == EAGAIN || errno == ENOBUFS) return WEFT_BUSY;
    set_err(p, "sendmsg");
    return (errno == ECONNREFUSED || errno == ENOENT) ? WEFT_EPEER : WEFT_EFAIL;
}

static void deliver(prov_t *p, const WeftSink *s, const unsigned char *m, size_t len) {
    if (len < PREFIX) return;
    uint32_t src;
    uint16_t hl;
    memcpy(&src, m, 4);
    memcpy(&hl, m + 4, 2);
    if (src >= p->size || PREFIX + (size_t)hl > len) return; /* malformed: dropped */
    s->am(s->ctx, src, m + PREFIX, hl, m + PREFIX + hl, len - PREFIX - hl);
}

static int32_t progress(void *h, const WeftSink *s, size_t *events) {
    prov_t *p = h;
    size_t n = 0;
#ifndef CDGRAM_ABI_1_0
    if (s->size >= sizeof(WeftSink) && s->connection) {
        for (size_t i = 0; i < p->nevents; i++) s->connection(s->ctx, p->events[i], WEFT_CONN_CONNECTED);
        n += p->nevents;
    }
#endif
    p->nevents = 0;
    while (p->self_head != p->self_tail) {
        size_t i = p->self_head % p->self_cap;
        p->self_head++;
        deliver(p, s, p->selfq[i], p->selflen[i]);
        free(p->selfq[i]);
        n++;
    }
    for (;;) {
        ssize_t r = recv(p->fd, p->buf, PREFIX + MAX_HEADER + MAX_PAYLOAD, MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EAGAIN) break;
            set_err(p, "recv");
            return WEFT_EFAIL;
        }
        deliver(p, s, p->buf, (size_t)r);
        n++;
    }
    *events = n;
    return WEFT_OK;
}

static const char *last_error(void *h) {
    return h ? ((prov_t *)h)->err : last_err;
}

static const WeftAmOps AM = {
    .size = sizeof(WeftAmOps),
    .probe = probe,
    .caps = caps,
    .open = open_,
    .close = close_,
    .am_send = am_send,
    .progress = progress,
    .last_error = last_error,
};

#ifndef CDGRAM_ABI_1_0
static const WeftExtOps EXT = {
    .size = sizeof(WeftExtOps),
    .connect = connect_,
};
#endif

static const WeftEntry ENTRY = {
    .abi_version = CDGRAM_ABI,
#ifdef CDGRAM_ABI_1_0
    .size = offsetof(WeftEntry, ext), /* a 1.0 entry ends before `ext` */
#else
    .size = sizeof(WeftEntry),
    .ext = &EXT,
#endif
    .name = CDGRAM_NAME,
    .version = "0.1.0",
    .summary = "example C provider: UNIX datagram sockets",
    .priority = 4,
    .am = &AM,
};

const WeftEntry *weft_provider_entry(void) { return &ENTRY; }
