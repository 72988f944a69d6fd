/* Deliberately broken provider libraries for the loader's tests; one variant per -D flag. */
#include <stddef.h>
#include "weft_provider.h"

static int32_t probe(const WeftProbeCtx *c, char *w, size_t n) { (void)c; (void)w; (void)n; return 0; }
static int32_t caps(WeftCaps *c) { (void)c; return 0; }
static int32_t open_(const WeftBoot *b, void **o) { (void)b; (void)o; return -1; }
static int32_t close_(void *h) { (void)h; return 0; }
static int32_t send_(void *h, uint32_t d, const uint8_t *a, size_t b, const WeftIov *i, size_t n) {
    (void)h; (void)d; (void)a; (void)b; (void)i; (void)n; return 0;
}
static int32_t progress(void *h, const WeftSink *s, size_t *e) { (void)h; (void)s; *e = 0; return 0; }
static const char *last_error(void *h) { (void)h; return "broken on purpose"; }

static const WeftAmOps AM = {
    .size = sizeof(WeftAmOps),
    .probe = probe, .caps = caps, .open = open_, .close = close_, .am_send = send_,
#ifndef NO_PROGRESS
    .progress = progress,
#endif
    .last_error = last_error,
};

static const WeftEntry ENTRY = {
#if defined(BAD_MAJOR)
    .abi_version = (2u << 16),
#elif defined(NEWER_MINOR)
    .abi_version = (1u << 16) | 7u,
#else
    .abi_version = WEFT_ABI_VERSION,
#endif
#ifdef SMALL_ENTRY
    .size = 8,
#else
    .size = sizeof(WeftEntry),
#endif
    .name = NAME,
    .version = "0",
    .summary = "broken",
    .am = &AM,
};

#ifndef NO_SYMBOL
const WeftEntry *weft_provider_entry(void) {
#ifdef NULL_ENTRY
    return NULL;
#else
    return &ENTRY;
#endif
}
#endif
