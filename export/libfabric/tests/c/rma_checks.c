/* weft-fi's RMA, atomics and counters as a libfabric program meets them, under
 * `weft run -n 2` (or `srun --mpi=pmix -n 2`): writes and reads of 8 B to 4 MiB both ways with data checks, remote CQ data,
 * inject, fetch-and-add from both ranks at once (the total and the order of the values each
 * rank fetched), compare-and-swap that exactly one rank wins, min on signed values, atomic
 * reads, the *valid queries, counters (fi_cntr_wait), and the error paths: an unknown key, an
 * access past a region's end (the bytes after it untouched), a region without the right, a
 * closed region, oversize injects and unsupported atomics. MODE=virt (FI_MR_VIRT_ADDR |
 * FI_MR_PROV_KEY, as Open MPI's btl/ofi asks) or MODE=offset (requested keys, offsets).
 * Prints "all checks passed" or names the first that failed and exits 1. */
#include <rdma/fabric.h>
#include <rdma/fi_atomic.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHECK(cond, ...)                                                            \
	do {                                                                        \
		if (!(cond)) {                                                      \
			fprintf(stderr, "rank %d: FAILED (line %d): ", rank, __LINE__); \
			fprintf(stderr, __VA_ARGS__);                               \
			fprintf(stderr, "\n");                                      \
			exit(1);                                                    \
		}                                                                   \
	} while (0)

#define WIN (4u << 20)
#define GUARD 4096

static int rank, virt;
static struct fid_ep *ep;
static struct fid_cq *cq;
static fi_addr_t peer;

struct exposed {
	uint64_t win_key, win_addr, ro_key, ro_addr, ctr_key, ctr_addr, tmp_key, tmp_addr;
};

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The next completion (bounded): 0, or the positive error of an error entry. */
static int next(struct fi_cq_data_entry *c)
{
	double t0 = now();
	for (;;) {
		ssize_t r = fi_cq_read(cq, c, 1);
		if (r == 1)
			return 0;
		if (r == -FI_EAVAIL) {
			struct fi_cq_err_entry e = {0};
			CHECK(fi_cq_readerr(cq, &e, 0) == 1, "fi_cq_readerr");
			c->op_context = e.op_context;
			c->flags = e.flags;
			return e.err;
		}
		CHECK(r == -FI_EAGAIN, "fi_cq_read: %zd", r);
		CHECK(now() - t0 < 30, "no completion within 30 s");
	}
}

/* Wait for the completion of the operation with context `ctx`; its status. Receives of
 * remote CQ data that come first are kept for `remote_data`. */
static uint64_t remote_data[8];
static int n_remote;
static int wait_for(void *ctx)
{
	for (;;) {
		struct fi_cq_data_entry c = {0};
		int e = next(&c);
		if (c.flags & FI_REMOTE_CQ_DATA && c.flags & FI_REMOTE_WRITE) {
			CHECK(n_remote < 8, "too many remote CQ data entries");
			remote_data[n_remote++] = c.data;
			continue;
		}
		if (c.op_context == ctx)
			return e;
		CHECK(0, "a completion for another operation (flags %llx)", (unsigned long long)c.flags);
	}
}

/* Both ranks here: a zero-byte tagged message each way. */
static void barrier(int tag)
{
	struct fi_context2 s, r;
	CHECK(fi_trecv(ep, NULL, 0, NULL, peer, tag, 0, &r) == 0, "fi_trecv");
	CHECK(fi_tsend(ep, NULL, 0, NULL, peer, tag, &s) == 0, "fi_tsend");
	int got = 0;
	while (got < 2) {
		struct fi_cq_data_entry c = {0};
		CHECK(next(&c) == 0, "barrier completion");
		if (c.flags & FI_REMOTE_CQ_DATA && c.flags & FI_REMOTE_WRITE) {
			remote_data[n_remote++] = c.data;
			continue;
		}
		CHECK(c.op_context == &s || c.op_context == &r, "barrier: another completion");
		got++;
	}
}

static unsigned char pattern(int from, size_t i) { return (unsigned char)(from * 77 + i * 13 + 5); }

int main(int argc, char **argv)
{
	/* The rank: weft run and Hydra say PMI_RANK, srun SLURM_PROCID. */
	const char *env = getenv("PMI_RANK") ? getenv("PMI_RANK") : getenv("SLURM_PROCID");
	rank = env ? atoi(env) : 0;
	virt = !getenv("MODE") || strcmp(getenv("MODE"), "offset") != 0;
	struct fi_info *hints = fi_allocinfo(), *info;
	hints->ep_attr->type = FI_EP_RDM;
	hints->caps = FI_TAGGED | FI_RMA | FI_ATOMIC;
	hints->mode = FI_CONTEXT | FI_CONTEXT2;
	hints->domain_attr->mr_mode =
		virt ? (FI_MR_VIRT_ADDR | FI_MR_PROV_KEY | FI_MR_ALLOCATED) : 0;
	hints->domain_attr->name = strdup(getenv("DOMAIN") ? getenv("DOMAIN") : "shm");
	hints->fabric_attr->prov_name = strdup("weft");
	CHECK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info) == 0, "fi_getinfo");
	CHECK((info->caps & (FI_RMA | FI_ATOMIC)) == (FI_RMA | FI_ATOMIC), "RMA and atomics offered");
	CHECK(virt ? info->domain_attr->mr_mode == (FI_MR_VIRT_ADDR | FI_MR_PROV_KEY)
		   : info->domain_attr->mr_mode == 0,
	      "MR mode %d", info->domain_attr->mr_mode);
	struct fid_fabric *fab;
	struct fid_domain *dom;
	struct fid_av *av;
	struct fid_cntr *wc, *rc, *remote;
	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_DATA};
	struct fi_av_attr av_attr = {.type = FI_AV_MAP};
	struct fi_cntr_attr cntr_attr = {.events = FI_CNTR_EVENTS_COMP};
	CHECK(fi_fabric(info->fabric_attr, &fab, NULL) == 0, "fi_fabric");
	CHECK(fi_domain(fab, info, &dom, NULL) == 0, "fi_domain");
	CHECK(fi_cq_open(dom, &cq_attr, &cq, NULL) == 0, "fi_cq_open");
	CHECK(fi_av_open(dom, &av_attr, &av, NULL) == 0, "fi_av_open");
	CHECK(fi_cntr_open(dom, &cntr_attr, &wc, NULL) == 0, "fi_cntr_open");
	CHECK(fi_cntr_open(dom, &cntr_attr, &rc, NULL) == 0, "fi_cntr_open");
	CHECK(fi_cntr_open(dom, &cntr_attr, &remote, NULL) == 0, "fi_cntr_open");
	CHECK(fi_endpoint(dom, info, &ep, NULL) == 0, "fi_endpoint");
	CHECK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV) == 0, "bind cq");
	CHECK(fi_ep_bind(ep, &av->fid, 0) == 0, "bind av");
	CHECK(fi_ep_bind(ep, &wc->fid, FI_WRITE) == 0, "bind write counter");
	CHECK(fi_ep_bind(ep, &rc->fid, FI_READ) == 0, "bind read counter");
	CHECK(fi_ep_bind(ep, &remote->fid, FI_REMOTE_WRITE) == 0, "bind remote counter");
	CHECK(fi_enable(ep) == 0, "fi_enable");

	/* The window between two guard areas; a read-only region; a counter; a region that
	 * rank 1 closes. */
	unsigned char *mem = malloc(WIN + 2 * GUARD), *win = mem + GUARD;
	memset(mem, 0xee, WIN + 2 * GUARD);
	memset(win, 0, WIN);
	uint64_t ro[8] = {11, 22, 33, 44, 55, 66, 77, 88}, ctr[4] = {0, 0, 0, 0}, tmp[8] = {0};
	struct fid_mr *mr_win, *mr_ro, *mr_ctr, *mr_tmp, *mr_dup;
	uint64_t base = 10 * rank;
	CHECK(fi_mr_reg(dom, win, WIN, FI_REMOTE_READ | FI_REMOTE_WRITE, 0, base + 1, 0, &mr_win, NULL) == 0,
	      "fi_mr_reg window");
	CHECK(fi_mr_reg(dom, ro, sizeof ro, FI_REMOTE_READ, 0, base + 2, 0, &mr_ro, NULL) == 0,
	      "fi_mr_reg read-only");
	CHECK(fi_mr_reg(dom, ctr, sizeof ctr, 0, 0, base + 3, 0, &mr_ctr, NULL) == 0, "fi_mr_reg counter");
	CHECK(fi_mr_reg(dom, tmp, sizeof tmp, 0, 0, base + 4, 0, &mr_tmp, NULL) == 0, "fi_mr_reg tmp");
	int dup = fi_mr_reg(dom, tmp, sizeof tmp, 0, 0, base + 4, 0, &mr_dup, NULL);
	CHECK(virt ? dup == 0 : dup == -FI_ENOKEY, "a requested key taken already: %d", dup);
	struct exposed me = {
		fi_mr_key(mr_win), virt ? (uint64_t)(uintptr_t)win : 0,
		fi_mr_key(mr_ro),  virt ? (uint64_t)(uintptr_t)ro : 0,
		fi_mr_key(mr_ctr), virt ? (uint64_t)(uintptr_t)ctr : 0,
		fi_mr_key(mr_tmp), virt ? (uint64_t)(uintptr_t)tmp : 0,
	};
	CHECK(virt || me.win_key == base + 1, "the requested key");

	/* Exchange names and regions through files. */
	char name[64], path[512];
	size_t len = sizeof name;
	CHECK(fi_getname(&ep->fid, name, &len) == 0, "fi_getname");
	snprintf(path, sizeof path, "%s.%d.tmp", argv[1], rank);
	FILE *f = fopen(path, "wb");
	fwrite(&me, sizeof me, 1, f);
	fwrite(name, 1, len, f);
	fclose(f);
	char final[512];
	snprintf(final, sizeof final, "%s.%d", argv[1], rank);
	rename(path, final);
	snprintf(path, sizeof path, "%s.%d", argv[1], 1 - rank);
	struct exposed you;
	char pname[64];
	double t0 = now();
	for (;;) {
		f = fopen(path, "rb");
		if (f && fread(&you, sizeof you, 1, f) == 1 && fread(pname, 1, len, f) == len)
			break;
		if (f)
			fclose(f);
		CHECK(now() - t0 < 30, "the peer's name arrived");
		usleep(1000);
	}
	fclose(f);
	CHECK(fi_av_insert(av, pname, 1, &peer, 0, NULL) == 1, "fi_av_insert");
	barrier(1);

	/* Writes of every size class into the peer's window, then reads of them back. */
	size_t sizes[] = {8, 4096, 4097, 65536, 1u << 20, WIN};
	size_t nsizes = sizeof sizes / sizeof sizes[0];
	unsigned char *src = malloc(WIN), *dst = malloc(WIN);
	for (size_t i = 0; i < WIN; i++) src[i] = pattern(rank, i);
	uint64_t writes = 0, reads = 0;
	for (size_t k = 0; k < nsizes; k++) {
		size_t n = sizes[k], off = WIN - n;
		struct fi_context2 c;
		CHECK(fi_write(ep, src + off, n, NULL, peer, you.win_addr + off, you.win_key, &c) == 0,
		      "fi_write of %zu", n);
		CHECK(wait_for(&c) == 0, "write of %zu completes", n);
		writes++;
	}
	CHECK(fi_cntr_wait(wc, writes, 5000) == 0 && fi_cntr_read(wc) == writes,
	      "the write counter says %llu", (unsigned long long)fi_cntr_read(wc));
	barrier(2);
	/* The last write, the whole window, covered the others. */
	for (size_t i = 0; i < WIN; i++)
		CHECK(win[i] == pattern(1 - rank, i), "window byte %zu after the peer's writes", i);
	for (size_t i = 0; i < GUARD; i++)
		CHECK(mem[i] == 0xee && mem[GUARD + WIN + i] == 0xee, "guard bytes untouched");
	CHECK(fi_cntr_read(remote) >= writes, "the remote-write counter");
	for (size_t k = 0; k < nsizes; k++) {
		size_t n = sizes[k], off = (k * 4099) % (WIN - n + 1);
		struct fi_context2 c;
		memset(dst, 0, n);
		CHECK(fi_read(ep, dst, n, NULL, peer, you.win_addr + off, you.win_key, &c) == 0,
		      "fi_read of %zu", n);
		CHECK(wait_for(&c) == 0, "read of %zu completes", n);
		reads++;
		for (size_t i = 0; i < n; i++)
			CHECK(dst[i] == pattern(rank, off + i), "read of %zu: byte %zu", n, i);
	}
	CHECK(fi_cntr_read(rc) == reads, "the read counter");

	/* Remote CQ data and inject. */
	{
		struct fi_context2 c;
		CHECK(fi_writedata(ep, src, 16, NULL, 0xabc0 + rank, peer, you.win_addr, you.win_key, &c) == 0,
		      "fi_writedata");
		CHECK(wait_for(&c) == 0, "writedata completes");
		CHECK(fi_inject_write(ep, src, 64, peer, you.win_addr + 64, you.win_key) == 0, "fi_inject_write");
		CHECK(fi_inject_write(ep, src, 1 << 20, peer, you.win_addr, you.win_key) == -FI_EINVAL,
		      "an inject larger than inject_size");
		CHECK(fi_cntr_wait(wc, writes + 2, 5000) == 0, "the inject is counted");
		barrier(3);
		CHECK(n_remote == 1 && remote_data[0] == 0xabc0 + (uint64_t)(1 - rank),
		      "the peer's remote CQ data (%d entries)", n_remote);
	}

	/* Atomics: fetch-and-add from both ranks on rank 0's counter at once. */
	{
		const int n = 1000;
		uint64_t one = 1, got, last = 0;
		size_t count;
		CHECK(fi_fetch_atomicvalid(ep, FI_UINT64, FI_SUM, &count) == 0 && count >= 1, "fetch SUM valid");
		CHECK(fi_compare_atomicvalid(ep, FI_UINT64, FI_CSWAP, &count) == 0, "CSWAP valid");
		CHECK(fi_atomicvalid(ep, FI_DOUBLE, FI_BOR, &count) == -FI_EOPNOTSUPP, "BOR on doubles refused");
		struct fi_atomic_attr aa;
		CHECK(fi_query_atomic(dom, FI_INT32, FI_MIN, &aa, 0) == 0 && aa.size == 4, "fi_query_atomic");
		/* Rank 0's counter: rank 0 reaches it through its own name, as Open MPI does. */
		uint64_t ckey = rank == 0 ? me.ctr_key : you.ctr_key, caddr = rank == 0 ? me.ctr_addr : you.ctr_addr;
		fi_addr_t self_addr;
		CHECK(fi_av_insert(av, name, 1, &self_addr, 0, NULL) == 1, "insert this process's own name");
		fi_addr_t zero = rank == 0 ? self_addr : peer;
		for (int i = 0; i < n; i++) {
			struct fi_context2 c;
			CHECK(fi_fetch_atomic(ep, &one, 1, NULL, &got, NULL, zero, caddr, ckey, FI_UINT64, FI_SUM, &c) == 0,
			      "fi_fetch_atomic");
			CHECK(wait_for(&c) == 0, "fetch-and-add completes");
			CHECK(i == 0 || got > last, "fetched values grow: %llu after %llu", (unsigned long long)got,
			      (unsigned long long)last);
			last = got;
		}
		barrier(4);
		if (rank == 0)
			CHECK(ctr[0] == 2 * (uint64_t)n, "the counter is %llu", (unsigned long long)ctr[0]);
		/* Compare-and-swap of 2n for rank+1: exactly one wins. */
		uint64_t cmp = 2 * (uint64_t)n, mine = rank + 1, old;
		struct fi_context2 c;
		CHECK(fi_compare_atomic(ep, &mine, 1, NULL, &cmp, NULL, &old, NULL, zero, caddr, ckey, FI_UINT64,
					FI_CSWAP, &c) == 0,
		      "fi_compare_atomic");
		CHECK(wait_for(&c) == 0, "compare-and-swap completes");
		barrier(5);
		if (rank == 0)
			CHECK(ctr[0] == 1 || ctr[0] == 2, "one swap won: %llu", (unsigned long long)ctr[0]);
		CHECK((old == cmp) == (ctr[0] == mine) || rank == 1, "the winner saw the old value");
		/* Min on signed values in element 1; an atomic read with no operand. */
		int64_t v = -5 - rank;
		CHECK(fi_atomic(ep, &v, 1, NULL, zero, caddr + 8, ckey, FI_INT64, FI_MIN, &c) == 0,
		      "fi_atomic MIN");
		CHECK(wait_for(&c) == 0, "MIN completes");
		barrier(6);
		int64_t r;
		CHECK(fi_fetch_atomic(ep, NULL, 1, NULL, &r, NULL, zero, caddr + 8, ckey, FI_INT64, FI_ATOMIC_READ, &c) == 0,
		      "fi_fetch_atomic ATOMIC_READ");
		CHECK(wait_for(&c) == 0 && r == -6, "the minimum is %lld", (long long)r);
		CHECK(fi_atomic(ep, &v, 1, NULL, zero, caddr, ckey, FI_DOUBLE, FI_BXOR, &c) == -FI_EOPNOTSUPP,
		      "an unsupported atomic is -FI_EOPNOTSUPP");
	}

	/* Error paths: each an error entry, FI_EACCES, and nothing written. */
	{
		struct fi_context2 c;
		CHECK(fi_write(ep, src, 8, NULL, peer, you.win_addr, you.win_key + 1000, &c) == 0, "write, bad key");
		CHECK(wait_for(&c) == FI_EACCES, "an unknown key is FI_EACCES");
		CHECK(fi_write(ep, src, 8192, NULL, peer, you.win_addr + WIN - 4096, you.win_key, &c) == 0,
		      "write past the end");
		CHECK(wait_for(&c) == FI_EACCES, "past the end is FI_EACCES");
		CHECK(fi_write(ep, src, 8, NULL, peer, you.win_addr + WIN - 4, you.win_key, &c) == 0,
		      "short write past the end");
		CHECK(wait_for(&c) == FI_EACCES, "a small write past the end is FI_EACCES");
		CHECK(fi_read(ep, dst, 16, NULL, peer, you.win_addr - 8, you.win_key, &c) == 0, "read before the start");
		CHECK(wait_for(&c) == FI_EACCES, "before the start is FI_EACCES");
		CHECK(fi_write(ep, src, 8, NULL, peer, you.ro_addr, you.ro_key, &c) == 0, "write, read-only");
		CHECK(wait_for(&c) == FI_EACCES, "a write to a read-only region is FI_EACCES");
		uint64_t one = 1, got;
		CHECK(fi_fetch_atomic(ep, &one, 1, NULL, &got, NULL, peer, you.ro_addr, you.ro_key, FI_UINT64, FI_SUM,
				      &c) == 0,
		      "atomic, read-only");
		CHECK(wait_for(&c) == FI_EACCES, "an atomic on a read-only region is FI_EACCES");
		CHECK(fi_read(ep, dst, sizeof ro, NULL, peer, you.ro_addr, you.ro_key, &c) == 0, "read, read-only");
		CHECK(wait_for(&c) == 0 && ((uint64_t *)dst)[7] == 88, "a read of a read-only region");
		CHECK(fi_cntr_readerr(wc) >= 3, "write errors are counted");
		CHECK(fi_write(ep, src, 8, NULL, 12345, you.win_addr, you.win_key, &c) == -FI_EINVAL,
		      "an unknown fi_addr");
		/* Rank 1 closes its region tmp; then rank 0 writes to it. */
		if (rank == 1)
			CHECK(fi_close(&mr_tmp->fid) == 0, "fi_close of a region");
		barrier(7);
		if (rank == 0) {
			CHECK(fi_write(ep, src, 8, NULL, peer, you.tmp_addr, you.tmp_key, &c) == 0, "write, closed");
			CHECK(wait_for(&c) == FI_EACCES, "a closed region is FI_EACCES");
		}
		barrier(8);
		if (rank == 1)
			for (int i = 0; i < 8; i++) CHECK(tmp[i] == 0, "a closed region untouched");
		for (size_t i = 0; i < GUARD; i++)
			CHECK(mem[i] == 0xee && mem[GUARD + WIN + i] == 0xee, "guard bytes untouched at the end");
		CHECK(ro[0] == 11, "the read-only region untouched");
	}

	barrier(9);
	CHECK(fi_close(&mr_win->fid) == 0, "fi_close of the window");
	CHECK(fi_close(&ep->fid) == 0, "fi_close of the endpoint");
	printf("rank %d: all checks passed\n", rank);
	/* The domain and fabric are left open, as many programs leave them: libfabric closes the
	 * provider from an exit handler, when the process's thread-locals are gone already. */
	return 0;
}
