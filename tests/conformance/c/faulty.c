/* "faulty": the C example provider with one deliberate defect, for testing that the
 * conformance suite catches a provider that corrupts data. It delivers every full-size payload
 * (MAX_PAYLOAD bytes, i.e. the chunks of large messages) with its last byte flipped; headers and
 * smaller payloads pass untouched, so the protocol keeps working and only data checks fail. */
#define weft_provider_entry cdgram_provider_entry
/* cdgram's 1.0 behaviour (addresses at open): this fixture has no ABI 1.1 `connect`. */
#define CDGRAM_ABI_1_0
#include "cdgram.c"
#undef weft_provider_entry

typedef struct {
    const WeftSink *inner;
    unsigned char copy[MAX_PAYLOAD];
} faulty_ctx_t;

static void faulty_am(void *ctx, uint32_t src, const uint8_t *hdr, uintptr_t hdr_len,
                      const uint8_t *payload, uintptr_t payload_len) {
    faulty_ctx_t *f = ctx;
    if (payload_len == MAX_PAYLOAD) {
        memcpy(f->copy, payload, payload_len);
        f->copy[payload_len - 1] ^= 0xff;
        payload = f->copy;
    }
    f->inner->am(f->inner->ctx, src, hdr, hdr_len, payload, payload_len);
}

static __thread faulty_ctx_t FCTX;

static int32_t faulty_progress(void *h, const WeftSink *s, uintptr_t *events) {
    WeftSink wrapped = *s;
    FCTX.inner = s;
    wrapped.ctx = &FCTX;
    wrapped.am = faulty_am;
    return progress(h, &wrapped, events);
}

static const WeftAmOps FAULTY_AM = {
    .size = sizeof(WeftAmOps),
    .probe = probe,
    .caps = caps,
    .open = open_,
    .close = close_,
    .am_send = am_send,
    .progress = faulty_progress,
    .last_error = last_error,
};

static const WeftEntry FAULTY_ENTRY = {
    .abi_version = WEFT_ABI_VERSION,
    .size = sizeof(WeftEntry),
    .name = "faulty",
    .version = "0.1.0",
    .summary = "cdgram that corrupts the last byte of full-size payloads (a test fixture)",
    .priority = 0,
    .am = &FAULTY_AM,
};

const WeftEntry *weft_provider_entry(void) { return &FAULTY_ENTRY; }
