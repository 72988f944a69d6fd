/* "closefail": the C example provider whose close fails (and frees its instance, as close
 * always does). The host must then read the reason from last_error(NULL), the thread's last
 * error, never from the instance it just closed: here a closed instance is kept and marked, and
 * last_error on it answers with a tell-tale text instead of reading freed memory. */
#define weft_provider_entry cdgram_provider_entry
/* cdgram's 1.0 behaviour (addresses at open): this fixture has no ABI 1.1 `connect`. */
#define CDGRAM_ABI_1_0
#include "cdgram.c"
#undef weft_provider_entry

static void *closed_handles[64];
static int nclosed;

static int32_t closefail_close(void *h) {
    if (nclosed < 64) closed_handles[nclosed++] = h; /* kept, not freed: see above */
    snprintf(last_err, sizeof last_err, "closefail: the fabric refused to close");
    return WEFT_EFAIL;
}

static const char *closefail_last_error(void *h) {
    for (int i = 0; i < nclosed; i++)
        if (closed_handles[i] == h) return "USE AFTER CLOSE: last_error asked a closed instance";
    return last_error(h);
}

static const WeftAmOps CLOSEFAIL_AM = {
    .size = sizeof(WeftAmOps),
    .probe = probe,
    .caps = caps,
    .open = open_,
    .close = closefail_close,
    .am_send = am_send,
    .progress = progress,
    .last_error = closefail_last_error,
};

static const WeftEntry CLOSEFAIL_ENTRY = {
    .abi_version = WEFT_ABI_VERSION,
    .size = sizeof(WeftEntry),
    .name = "closefail",
    .version = "0.1.0",
    .summary = "cdgram whose close fails (a test fixture)",
    .priority = 0,
    .am = &CLOSEFAIL_AM,
};

const WeftEntry *weft_provider_entry(void) { return &CLOSEFAIL_ENTRY; }
