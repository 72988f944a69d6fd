/* weft-fi's error paths as a libfabric program meets them, under `weft run -n 2`: the
 * two-step fi_getname, a name from another job, an unknown fi_addr, truncation (FI_ETRUNC with
 * olen), cancellation (FI_ECANCELED), vectored sends and receives (iov_limit), a call on a
 * closed object. Prints "ok" lines and exits 0,
 * or names the first check that failed and exits 1. Names are exchanged through a file
 * (argv[1]) that each rank writes and the other waits for (bounded). */
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHECK(cond, what)                                                   \
	do {                                                                \
		if (!(cond)) {                                              \
			fprintf(stderr, "rank %d: FAILED: %s (line %d)\n", rank, what, \
				__LINE__);                                  \
			exit(1);                                            \
		}                                                           \
		printf("rank %d: ok: %s\n", rank, what);                    \
	} while (0)

static int rank;

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Read a completion or an error entry (bounded); returns 1, or -FI_EAVAIL with *e filled. */
static ssize_t wait_cq(struct fid_cq *cq, struct fi_cq_tagged_entry *c, struct fi_cq_err_entry *e)
{
	double t0 = now();
	for (;;) {
		ssize_t r = fi_cq_read(cq, c, 1);
		if (r == 1)
			return 1;
		if (r == -FI_EAVAIL) {
			memset(e, 0, sizeof(*e));
			if (fi_cq_readerr(cq, e, 0) == 1)
				return -FI_EAVAIL;
		} else if (r != -FI_EAGAIN) {
			return r;
		}
		if (now() - t0 > 30) {
			fprintf(stderr, "rank %d: no completion within 30 s\n", rank);
			exit(1);
		}
	}
}

int main(int argc, char **argv)
{
	const char *env = getenv("PMI_RANK");
	rank = env ? atoi(env) : 0;
	char path[512];
	struct fi_info *hints = fi_allocinfo(), *info;
	hints->ep_attr->type = FI_EP_RDM;
	hints->caps = FI_TAGGED;
	hints->domain_attr->name = strdup(getenv("DOMAIN") ? getenv("DOMAIN") : "shm");
	/* libfabric's own shm provider has a domain "shm" too. */
	hints->fabric_attr->prov_name = strdup("weft");
	CHECK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info) == 0, "fi_getinfo");
	struct fid_fabric *fab;
	struct fid_domain *dom;
	struct fid_ep *ep;
	struct fid_cq *cq;
	struct fid_av *av;
	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED};
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
	CHECK(fi_fabric(info->fabric_attr, &fab, NULL) == 0, "fi_fabric");
	CHECK(fi_domain(fab, info, &dom, NULL) == 0, "fi_domain");
	CHECK(fi_cq_open(dom, &cq_attr, &cq, NULL) == 0, "fi_cq_open");
	CHECK(fi_av_open(dom, &av_attr, &av, NULL) == 0, "fi_av_open");
	CHECK(fi_endpoint(dom, info, &ep, NULL) == 0, "fi_endpoint");
	CHECK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV) == 0, "bind cq");
	CHECK(fi_ep_bind(ep, &av->fid, 0) == 0, "bind av");
	CHECK(fi_enable(ep) == 0, "fi_enable");

	char name[64];
	size_t len = 4;
	CHECK(fi_getname(&ep->fid, name, &len) == -FI_ETOOSMALL && len > 4,
	      "fi_getname with a small buffer says -FI_ETOOSMALL and the size");
	CHECK(fi_getname(&ep->fid, name, &len) == 0, "fi_getname");

	/* Exchange names through files, as fi_pingpong does through a socket. */
	snprintf(path, sizeof(path), "%s.%d", argv[1], rank);
	FILE *f = fopen(path, "wb");
	fwrite(name, 1, len, f);
	fclose(f);
	snprintf(path, sizeof(path), "%s.%d", argv[1], 1 - rank);
	char peer[64];
	double t0 = now();
	for (;;) {
		f = fopen(path, "rb");
		if (f && fread(peer, 1, len, f) == len)
			break;
		if (f)
			fclose(f);
		CHECK(now() - t0 < 30, "the peer's name arrived");
		usleep(1000);
	}
	fclose(f);

	/* A name of another job: the entry fails, never a wrong peer. */
	char alien[64];
	memcpy(alien, peer, len);
	alien[8] ^= 0x5a;
	fi_addr_t bad = 0;
	fi_addr_t a;
	CHECK(fi_av_insert(av, peer, 1, &a, 0, NULL) == 1, "fi_av_insert of the peer");
	CHECK(fi_av_insert(av, alien, 1, &bad, 0, NULL) == 0 && bad == FI_ADDR_NOTAVAIL,
	      "a name from another job is refused");

	char buf[256];
	CHECK(fi_tsend(ep, buf, 8, NULL, a + 1000, 1, NULL) == -FI_EINVAL,
	      "a send to an unknown fi_addr is -FI_EINVAL");

	struct fi_cq_tagged_entry c;
	struct fi_cq_err_entry e;
	if (rank == 0) {
		memset(buf, 7, sizeof(buf));
		CHECK(fi_tsend(ep, buf, 200, NULL, a, 5, buf) == 0, "fi_tsend");
		CHECK(wait_cq(cq, &c, &e) == 1 && c.op_context == buf, "send completion");
		/* Wait for the peer's answer before closing. */
		CHECK(fi_trecv(ep, buf, 8, NULL, FI_ADDR_UNSPEC, 6, 0, buf) == 0, "fi_trecv");
		CHECK(wait_cq(cq, &c, &e) == 1 && c.len == 8, "the peer says it is done");
	} else {
		char small[64];
		CHECK(fi_trecv(ep, small, sizeof(small), NULL, FI_ADDR_UNSPEC, 5, 0, small) == 0,
		      "fi_trecv into a buffer too small");
		CHECK(wait_cq(cq, &c, &e) == -FI_EAVAIL && e.err == FI_ETRUNC && e.len == 64 &&
			      e.olen == 136 && e.op_context == small,
		      "truncation is an FI_ETRUNC error entry with olen");
		CHECK(fi_trecv(ep, buf, 8, NULL, FI_ADDR_UNSPEC, 99, 0, &e) == 0,
		      "a receive nothing matches");
		CHECK(fi_cancel(&ep->fid, &e) == 0, "fi_cancel");
		struct fi_cq_err_entry e2;
		CHECK(wait_cq(cq, &c, &e2) == -FI_EAVAIL && e2.err == FI_ECANCELED &&
			      e2.op_context == &e,
		      "the cancelled receive is an FI_ECANCELED error entry");
		CHECK(fi_tsend(ep, buf, 8, NULL, a, 6, buf) == 0, "fi_tsend");
		CHECK(wait_cq(cq, &c, &e) == 1, "send completion");
	}
	/* Vectored messages: the send's iovec entries gathered in their order (not their
	 * addresses'), the receive's filled one after the other, whatever the two splits, short
	 * (inline) and long (rendezvous); more entries than iov_limit is -FI_EINVAL. */
	size_t lim = info->tx_attr->iov_limit;
	CHECK(lim >= 4 && info->rx_attr->iov_limit == lim, "iov_limit of 4 or more, both ways");
	{
		static struct iovec many[1024];
		CHECK(lim < 1024 && fi_tsendv(ep, many, NULL, lim + 1, a, 1, NULL) == -FI_EINVAL,
		      "a send of more than iov_limit entries is -FI_EINVAL");
		CHECK(fi_trecvv(ep, many, NULL, lim + 1, FI_ADDR_UNSPEC, 1, 0, NULL) == -FI_EINVAL,
		      "a receive of more than iov_limit entries is -FI_EINVAL");
	}
	static unsigned char vmem[3][400000], vgot[4][400000];
	const size_t sizes[2] = {300, 500000};
	for (int k = 0; k < 2; k++) {
		size_t n = sizes[k], cut1 = n / 3, cut2 = n / 3 + 5;
		uint64_t tag = 0x7700 + k;
		if (rank == 0) {
			/* Pieces [0, cut1) in vmem[2], [cut1, cut2) in vmem[0], the rest in vmem[1]:
			 * memory order differs from message order. */
			for (size_t i = 0; i < n; i++) {
				unsigned char v = (unsigned char)(i * 13 + k);
				if (i < cut1)
					vmem[2][i] = v;
				else if (i < cut2)
					vmem[0][i - cut1] = v;
				else
					vmem[1][i - cut2] = v;
			}
			struct iovec iov[4] = {{NULL, 0}, {vmem[2], cut1}, {vmem[0], cut2 - cut1},
					       {vmem[1], n - cut2}};
			if (k == 0) {
				CHECK(fi_tsendv(ep, iov, NULL, 4, a, tag, iov) == 0, "fi_tsendv, short");
			} else {
				struct fi_msg_tagged m = {.msg_iov = iov, .iov_count = 4, .addr = a,
							  .tag = tag, .context = iov};
				CHECK(fi_tsendmsg(ep, &m, FI_COMPLETION) == 0, "fi_tsendmsg of 4 entries, long");
			}
			CHECK(wait_cq(cq, &c, &e) == 1 && c.op_context == iov, "vectored send completion");
		} else {
			size_t r1 = n / 4, r2 = n / 4 + 1, r3 = n - 2;
			size_t lens[4] = {r1, r2 - r1, r3 - r2, n - r3};
			memset(vgot, 0xEE, sizeof(vgot));
			struct iovec iov[5];
			for (int j = 0; j < 4; j++) {
				iov[j].iov_base = vgot[j] + 8;
				iov[j].iov_len = lens[j];
			}
			iov[4] = iov[3];
			iov[3].iov_base = NULL;
			iov[3].iov_len = 0;
			if (k == 0) {
				CHECK(fi_trecvv(ep, iov, NULL, 5, FI_ADDR_UNSPEC, tag, 0, iov) == 0,
				      "fi_trecvv, short");
			} else {
				struct fi_msg_tagged m = {.msg_iov = iov, .iov_count = 5,
							  .addr = FI_ADDR_UNSPEC, .tag = tag, .context = iov};
				CHECK(fi_trecvmsg(ep, &m, FI_COMPLETION) == 0, "fi_trecvmsg of 5 entries, long");
			}
			CHECK(wait_cq(cq, &c, &e) == 1 && c.op_context == iov && c.len == n,
			      "vectored receive completion with the message's length");
			size_t at = 0, bad = 0;
			for (int j = 0; j < 4; j++) {
				for (size_t i = 0; i < 8; i++)
					bad += vgot[j][i] != 0xEE || vgot[j][8 + lens[j] + i] != 0xEE;
				for (size_t i = 0; i < lens[j]; i++, at++)
					bad += vgot[j][8 + i] != (unsigned char)(at * 13 + k);
			}
			CHECK(bad == 0, "the bytes scattered in order, those around each entry untouched");
		}
	}
	/* libfabric's matching: 64-bit tags with a partial ignore mask, remote CQ data, FI_PEEK,
	 * FI_CLAIM and FI_DISCARD, on short and long (rendezvous) messages. */
	static unsigned char big[100000], got[100000];
	const uint64_t T1 = 0x123456789abcdef0ull, T2 = 0xaaaa000000000001ull,
		       T3 = 0xaaaa000000000002ull, T4 = 0xbbbb00000000ffffull;
	if (rank == 0) {
		for (size_t i = 0; i < sizeof(big); i++)
			big[i] = (unsigned char)(i * 7 + 1);
		memset(buf, 9, sizeof(buf));
		CHECK(fi_tsenddata(ep, buf, 16, NULL, 0xfeedbeefcafeull, a, T1, buf) == 0,
		      "fi_tsenddata");
		CHECK(wait_cq(cq, &c, &e) == 1, "senddata completion");
		CHECK(fi_tinject(ep, buf, 4, a, T2) == 0, "fi_tinject (to be peeked and claimed)");
		CHECK(fi_tinjectdata(ep, buf, 4, 42, a, T3) == 0, "fi_tinjectdata (to be discarded)");
		CHECK(fi_tsend(ep, big, sizeof(big), NULL, a, T4, big) == 0, "a long fi_tsend");
		CHECK(wait_cq(cq, &c, &e) == 1 && c.op_context == big, "long send completion");
		CHECK(fi_trecv(ep, buf, 8, NULL, FI_ADDR_UNSPEC, 7, 0, buf) == 0, "fi_trecv");
		if (getenv("KILL_AT_END")) {
			double t1 = now();
			CHECK(wait_cq(cq, &c, &e) == -FI_EAVAIL && e.err == FI_EIO &&
				      e.op_context == buf,
			      "the receive the killed peer would have matched is an FI_EIO entry");
			printf("rank 0: the error entry came %.0f ms after the receive\n",
			       (now() - t1) * 1e3);
		} else {
			CHECK(wait_cq(cq, &c, &e) == 1, "the peer's matching checks are done");
		}
	} else {
		char r[64];
		CHECK(fi_trecv(ep, r, sizeof(r), NULL, FI_ADDR_UNSPEC, 0x1234000000000000ull,
			       0x0000ffffffffffffull, r) == 0,
		      "fi_trecv with a partial ignore mask");
		CHECK(wait_cq(cq, &c, &e) == 1 && c.tag == T1 && c.len == 16 &&
			      (c.flags & FI_REMOTE_CQ_DATA) && c.data == 0xfeedbeefcafeull,
		      "it matched, with the whole tag and the remote CQ data");
		struct fi_msg_tagged m = {0};
		struct iovec iov = {.iov_base = r, .iov_len = sizeof(r)};
		struct fi_context pc;
		m.addr = FI_ADDR_UNSPEC;
		m.context = &pc;
		/* Peek until the message is there (-FI_ENOMSG error entries until then). */
		ssize_t got_one;
		double t1 = now();
		do {
			m.tag = T2;
			CHECK(fi_trecvmsg(ep, &m, FI_PEEK) == 0, "FI_PEEK");
			got_one = wait_cq(cq, &c, &e);
			if (got_one != 1)
				CHECK(e.err == FI_ENOMSG && now() - t1 < 30,
				      "a peek that finds nothing is FI_ENOMSG");
		} while (got_one != 1);
		CHECK(c.tag == T2 && c.len == 4 && c.op_context == &pc, "FI_PEEK finds the message");
		CHECK(fi_trecvmsg(ep, &m, FI_PEEK | FI_CLAIM) == 0 && wait_cq(cq, &c, &e) == 1,
		      "FI_PEEK | FI_CLAIM");
		CHECK(fi_trecvmsg(ep, &m, FI_PEEK) == 0 && wait_cq(cq, &c, &e) == -FI_EAVAIL &&
			      e.err == FI_ENOMSG,
		      "a claimed message is no longer seen by a peek");
		m.msg_iov = &iov;
		m.iov_count = 1;
		memset(r, 0, sizeof(r));
		CHECK(fi_trecvmsg(ep, &m, FI_CLAIM) == 0 && wait_cq(cq, &c, &e) == 1 &&
			      c.len == 4 && r[0] == 9,
		      "FI_CLAIM receives the claimed message");
		m.msg_iov = NULL;
		m.iov_count = 0;
		m.tag = T3;
		t1 = now();
		do {
			CHECK(fi_trecvmsg(ep, &m, FI_PEEK | FI_DISCARD) == 0, "FI_PEEK | FI_DISCARD");
			got_one = wait_cq(cq, &c, &e);
			CHECK(got_one == 1 || now() - t1 < 30, "the discarded message arrives");
		} while (got_one != 1);
		CHECK((c.flags & FI_REMOTE_CQ_DATA) && c.data == 42, "the discarded one had its data");
		CHECK(fi_trecvmsg(ep, &m, FI_PEEK) == 0 && wait_cq(cq, &c, &e) == -FI_EAVAIL &&
			      e.err == FI_ENOMSG,
		      "a discarded message is gone");
		m.tag = T4;
		t1 = now();
		do {
			CHECK(fi_trecvmsg(ep, &m, FI_PEEK | FI_CLAIM) == 0, "FI_PEEK | FI_CLAIM, long");
			got_one = wait_cq(cq, &c, &e);
			CHECK(got_one == 1 || now() - t1 < 30, "the long message arrives");
		} while (got_one != 1);
		CHECK(c.len == sizeof(big), "a peek tells a long message's length");
		struct iovec giov = {.iov_base = got, .iov_len = sizeof(got)};
		m.msg_iov = &giov;
		m.iov_count = 1;
		CHECK(fi_trecvmsg(ep, &m, FI_CLAIM) == 0 && wait_cq(cq, &c, &e) == 1 &&
			      c.len == sizeof(got),
		      "FI_CLAIM receives the long message");
		size_t i = 0;
		while (i < sizeof(got) && got[i] == (unsigned char)(i * 7 + 1))
			i++;
		CHECK(i == sizeof(got), "its data");
		if (getenv("KILL_AT_END")) {
			/* The peer must see an error entry for its pending receive, not hang. */
			fflush(stdout);
			raise(SIGKILL);
		}
		CHECK(fi_tsend(ep, buf, 8, NULL, a, 7, buf) == 0 && wait_cq(cq, &c, &e) == 1,
		      "matching checks done");
	}
	CHECK(fi_close(&ep->fid) == 0, "close the endpoint");
	CHECK(fi_tsend(ep, buf, 8, NULL, a, 1, NULL) < 0, "a send on a closed endpoint fails");
	CHECK(fi_close(&ep->fid) == -FI_EINVAL, "closing it again is -FI_EINVAL");
	CHECK(fi_close(&av->fid) == 0 && fi_close(&cq->fid) == 0, "close av and cq");
	CHECK(fi_cq_read(cq, &c, 1) == -FI_EINVAL, "reading a closed CQ is -FI_EINVAL");
	CHECK(fi_close(&dom->fid) == 0 && fi_close(&fab->fid) == 0, "close domain and fabric");
	fi_freeinfo(info);
	fi_freeinfo(hints);
	printf("rank %d: all checks passed\n", rank);
	return 0;
}
