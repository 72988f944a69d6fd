/* weft's own checks of the drop-in libibverbs.so.1 (export/ibverbs): what a verbs program can
 * get wrong, and the completions and events it must then see, against Debian's
 * <infiniband/verbs.h>. One process, two RC QPs of one context connected to each other.
 * Built and run by cli/tests/ibverbs.rs with LD_LIBRARY_PATH at the drop-in. Prints one
 * "ok NAME" per check; exits 1 at the first failure. Every wait is bounded (5 s). */
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <infiniband/verbs.h>

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static union ibv_gid gid;

#define CHECK(name, cond, ...)                                                                 \
	do {                                                                                   \
		if (!(cond)) {                                                                 \
			printf("FAIL %s: ", name);                                             \
			printf(__VA_ARGS__);                                                   \
			printf("\n");                                                          \
			exit(1);                                                               \
		}                                                                              \
		printf("ok %s\n", name);                                                       \
		fflush(stdout);                                                                \
	} while (0)

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* One completion from `c` within 5 s (0 if none came). */
static int poll1(struct ibv_cq *c, struct ibv_wc *wc)
{
	double end = now() + 5;
	while (now() < end) {
		int n = ibv_poll_cq(c, 1, wc);
		if (n != 0)
			return n;
	}
	return 0;
}

static struct ibv_qp *rc_qp(struct ibv_srq *srq)
{
	struct ibv_qp_init_attr a = {
		.send_cq = cq, .recv_cq = cq, .srq = srq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 16, .max_send_sge = 2, .max_recv_sge = 2,
			 .max_inline_data = 64 },
	};
	return ibv_create_qp(pd, &a);
}

static int to_init(struct ibv_qp *q)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
						    IBV_ACCESS_REMOTE_ATOMIC };
	return ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

static int to_rts(struct ibv_qp *q, uint32_t dest, uint8_t rnr_retry)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024, .dest_qp_num = dest,
				 .rq_psn = 1, .max_dest_rd_atomic = 1, .min_rnr_timer = 1,
				 .ah_attr = { .is_global = 1, .port_num = 1, .grh = { .dgid = gid, .hop_limit = 1 } } };
	int r = ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				      IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
	if (r)
		return r;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = 1;
	a.timeout = 10;
	a.retry_cnt = 1;
	a.rnr_retry = rnr_retry;
	a.max_rd_atomic = 1;
	return ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
				      IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
}

/* Two RC QPs connected to each other. */
static void pair(struct ibv_qp **a, struct ibv_qp **b, uint8_t rnr_retry)
{
	*a = rc_qp(NULL);
	*b = rc_qp(NULL);
	if (!*a || !*b || to_init(*a) || to_init(*b) || to_rts(*a, (*b)->qp_num, rnr_retry) ||
	    to_rts(*b, (*a)->qp_num, rnr_retry)) {
		printf("FAIL setup: could not connect two RC QPs (errno %d)\n", errno);
		exit(1);
	}
}

static int post(struct ibv_qp *q, enum ibv_wr_opcode op, struct ibv_mr *mr, size_t off, uint32_t len,
		uint64_t raddr, uint32_t rkey)
{
	struct ibv_sge s = { .addr = (uintptr_t)mr->addr + off, .length = len, .lkey = mr->lkey };
	struct ibv_send_wr w = { .wr_id = 7, .sg_list = &s, .num_sge = 1, .opcode = op,
				 .send_flags = IBV_SEND_SIGNALED }, *bad;
	w.wr.rdma.remote_addr = raddr;
	w.wr.rdma.rkey = rkey;
	return ibv_post_send(q, &w, &bad);
}

/* Read asynchronous events (acknowledging each) until one of type `t` on object `el` comes;
 * 1 if it did within 5 s. */
static int wait_event(enum ibv_event_type t, void *el)
{
	double end = now() + 5;
	while (now() < end) {
		struct pollfd p = { .fd = ctx->async_fd, .events = POLLIN };
		struct ibv_async_event ev;
		if (poll(&p, 1, 100) != 1 || ibv_get_async_event(ctx, &ev) != 0)
			continue;
		int ok = ev.event_type == t && ev.element.qp == el;
		ibv_ack_async_event(&ev);
		if (ok)
			return 1;
	}
	return 0;
}

int main(void)
{
	int n;
	struct ibv_device **l = ibv_get_device_list(&n);
	CHECK("device_list", l && n == 1 && strcmp(ibv_get_device_name(l[0]), "weft0") == 0,
	      "%d devices", n);
	ctx = ibv_open_device(l[0]);
	CHECK("open", ctx != NULL, "errno %d", errno);
	ibv_free_device_list(l);

	struct ibv_port_attr pa;
	CHECK("port_is_roce_style", ibv_query_port(ctx, 1, &pa) == 0 &&
	      pa.link_layer == IBV_LINK_LAYER_ETHERNET && pa.state == IBV_PORT_ACTIVE, "link layer %d",
	      pa.link_layer);
	CHECK("bad_port", ibv_query_port(ctx, 2, &pa) != 0, "port 2 answered");
	CHECK("gid", ibv_query_gid(ctx, 1, 0, &gid) == 0 && gid.global.interface_id != 0, "no GID");
	CHECK("no_second_gid", ibv_query_gid(ctx, 1, 1, &gid) != 0, "index 1 answered");
	ibv_query_gid(ctx, 1, 0, &gid);

	pd = ibv_alloc_pd(ctx);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	cq = ibv_create_cq(ctx, 64, (void *)0x5eed, ch, 0);
	CHECK("pd_channel_cq", pd && ch && cq, "errno %d", errno);

	char *buf = calloc(1, 1 << 16);
	errno = 0;
	CHECK("reg_mr_remote_write_needs_local_write",
	      ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_REMOTE_WRITE) == NULL && errno == EINVAL, "errno %d",
	      errno);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 1 << 16, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
						       IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
	struct ibv_mr *ro = ibv_reg_mr(pd, buf + 8192, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	CHECK("reg_mr", mr && ro, "errno %d", errno);
	CHECK("dealloc_busy_pd", ibv_dealloc_pd(pd) == EBUSY, "a PD with MRs was freed");

	struct ibv_qp_init_attr uc = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_UC,
				       .cap = { .max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1,
						.max_recv_sge = 1 } };
	errno = 0;
	CHECK("uc_not_offered", ibv_create_qp(pd, &uc) == NULL && errno == EOPNOTSUPP, "errno %d", errno);

	struct ibv_qp *q = rc_qp(NULL);
	CHECK("create_rc", q != NULL, "errno %d", errno);
	struct ibv_qp_attr at = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	CHECK("init_without_access_flags", ibv_modify_qp(q, &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT) == EINVAL,
	      "accepted");
	CHECK("init_with_a_foreign_attribute",
	      ibv_modify_qp(q, &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS |
					    IBV_QP_SQ_PSN) == EINVAL, "accepted");
	at.qp_state = IBV_QPS_RTS;
	CHECK("reset_to_rts", ibv_modify_qp(q, &at, IBV_QP_STATE) == EINVAL, "accepted");
	{
		struct ibv_sge s = { .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
		struct ibv_send_wr w = { .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_SEND }, *bad = NULL;
		CHECK("post_send_in_reset", ibv_post_send(q, &w, &bad) == EINVAL && bad == &w, "accepted");
	}
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	CHECK("query_qp", ibv_query_qp(q, &qa, IBV_QP_STATE | IBV_QP_CAP, &qi) == 0 &&
	      qa.qp_state == IBV_QPS_RESET && qi.cap.max_inline_data >= 64, "state %d", qa.qp_state);
	{
		struct ibv_qp_attr r = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024, .dest_qp_num = 1,
					 .ah_attr = { .port_num = 1, .dlid = 1 } };
		to_init(q);
		CHECK("rtr_without_gid", ibv_modify_qp(q, &r, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
							IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
							IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == EINVAL,
		      "accepted");
		struct ibv_ah_attr aa = { .dlid = 1, .port_num = 1 };
		errno = 0;
		CHECK("ah_without_gid", ibv_create_ah(pd, &aa) == NULL && errno == EINVAL, "errno %d", errno);
	}
	ibv_destroy_qp(q);

	struct ibv_qp *a, *b;
	struct ibv_wc wc;
	pair(&a, &b, 7);
	{
		struct ibv_sge s = { .addr = (uintptr_t)buf + 4096, .length = 256, .lkey = mr->lkey };
		struct ibv_recv_wr r = { .wr_id = 42, .sg_list = &s, .num_sge = 1 }, *bad;
		CHECK("post_recv", ibv_post_recv(b, &r, &bad) == 0, "refused");
		CHECK("req_notify", ibv_req_notify_cq(cq, 0) == 0, "refused");
		memcpy(buf, "weft", 5);
		struct ibv_sge t = { .addr = (uintptr_t)buf, .length = 5, .lkey = mr->lkey };
		struct ibv_send_wr w = { .wr_id = 1, .sg_list = &t, .num_sge = 1,
					 .opcode = IBV_WR_SEND_WITH_IMM, .send_flags = IBV_SEND_SIGNALED,
					 .imm_data = htonl(0xabcd) }, *sbad;
		CHECK("send_with_imm", ibv_post_send(a, &w, &sbad) == 0, "refused");
		struct pollfd p = { .fd = ch->fd, .events = POLLIN };
		CHECK("channel_fd_readable", poll(&p, 1, 5000) == 1, "no event in 5 s");
		struct ibv_cq *ecq;
		void *ectx;
		CHECK("get_cq_event", ibv_get_cq_event(ch, &ecq, &ectx) == 0 && ecq == cq && ectx == (void *)0x5eed,
		      "wrong CQ");
		ibv_ack_cq_events(cq, 1);
		int got_recv = 0, got_send = 0;
		for (int i = 0; i < 2 && poll1(cq, &wc) == 1; i++) {
			if (wc.opcode == IBV_WC_RECV)
				got_recv = wc.status == IBV_WC_SUCCESS && wc.wr_id == 42 && wc.byte_len == 5 &&
					   (wc.wc_flags & IBV_WC_WITH_IMM) && ntohl(wc.imm_data) == 0xabcd &&
					   wc.qp_num == b->qp_num && memcmp(buf + 4096, "weft", 5) == 0;
			if (wc.opcode == IBV_WC_SEND)
				got_send = wc.status == IBV_WC_SUCCESS && wc.wr_id == 1;
		}
		CHECK("send_and_recv_completions", got_recv && got_send, "recv %d send %d", got_recv, got_send);
	}
	{
		uint64_t *t = (uint64_t *)(buf + 1024);
		*t = 10;
		struct ibv_sge s = { .addr = (uintptr_t)buf + 2048, .length = 8, .lkey = mr->lkey };
		struct ibv_send_wr w = { .wr_id = 3, .sg_list = &s, .num_sge = 1,
					 .opcode = IBV_WR_ATOMIC_FETCH_AND_ADD, .send_flags = IBV_SEND_SIGNALED },
				   *bad;
		w.wr.atomic.remote_addr = (uintptr_t)t;
		w.wr.atomic.rkey = mr->rkey;
		w.wr.atomic.compare_add = 5;
		CHECK("fetch_add", ibv_post_send(a, &w, &bad) == 0 && poll1(cq, &wc) == 1 &&
		      wc.status == IBV_WC_SUCCESS && *(uint64_t *)(buf + 2048) == 10 && *t == 15,
		      "status %d old %lu now %lu", wc.status, *(unsigned long *)(buf + 2048), (unsigned long)*t);
		w.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
		w.wr.atomic.compare_add = 15;
		w.wr.atomic.swap = 99;
		CHECK("compare_and_swap", ibv_post_send(a, &w, &bad) == 0 && poll1(cq, &wc) == 1 &&
		      wc.status == IBV_WC_SUCCESS && *t == 99, "now %lu", (unsigned long)*t);
	}
	CHECK("rdma_read", post(a, IBV_WR_RDMA_READ, mr, 0, 16, (uintptr_t)buf + 8192, ro->rkey) == 0 &&
	      poll1(cq, &wc) == 1 && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_READ,
	      "status %d", wc.status);
	CHECK("write_without_remote_write_right",
	      post(a, IBV_WR_RDMA_WRITE, mr, 0, 16, (uintptr_t)buf + 8192, ro->rkey) == 0 &&
	      poll1(cq, &wc) == 1 && wc.status == IBV_WC_REM_ACCESS_ERR, "status %s",
	      ibv_wc_status_str(wc.status));
	{
		/* The QP is in error now: what follows is flushed. */
		CHECK("flushed_after_error", post(a, IBV_WR_RDMA_WRITE, mr, 0, 16, (uintptr_t)buf, mr->rkey) == 0 &&
		      poll1(cq, &wc) == 1 && wc.status == IBV_WC_WR_FLUSH_ERR, "status %s",
		      ibv_wc_status_str(wc.status));
		while (ibv_poll_cq(cq, 1, &wc) > 0)
			;
	}
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);

	pair(&a, &b, 7);
	{
		/* 64 bytes at 32 before the region's end: refused whole, the 32 inside untouched. */
		char *tail = buf + (1 << 16) - 32;
		memset(tail, 0x5a, 32);
		memset(buf, 0xa5, 64);
		CHECK("write_outside_the_region",
		      post(a, IBV_WR_RDMA_WRITE, mr, 0, 64, (uintptr_t)tail, mr->rkey) == 0 &&
		      poll1(cq, &wc) == 1 && wc.status == IBV_WC_REM_ACCESS_ERR, "status %s",
		      ibv_wc_status_str(wc.status));
		int untouched = 1;
		for (int i = 0; i < 32; i++)
			untouched &= tail[i] == 0x5a;
		CHECK("target_untouched", untouched, "the refused write changed the target");
	}
	while (ibv_poll_cq(cq, 1, &wc) > 0)
		;
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);

	pair(&a, &b, 7);
	{
		struct ibv_sge s = { .addr = (uintptr_t)buf, .length = 16, .lkey = mr->lkey ^ 0x00ff0000 };
		struct ibv_send_wr w = { .wr_id = 11, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
					 .send_flags = IBV_SEND_SIGNALED }, *bad;
		w.wr.rdma.remote_addr = (uintptr_t)buf + 4096;
		w.wr.rdma.rkey = mr->rkey;
		CHECK("wrong_lkey", ibv_post_send(a, &w, &bad) == 0 && poll1(cq, &wc) == 1 &&
		      wc.status == IBV_WC_LOC_PROT_ERR && wc.wr_id == 11, "status %s",
		      ibv_wc_status_str(wc.status));
	}
	while (ibv_poll_cq(cq, 1, &wc) > 0)
		;
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);

	pair(&a, &b, 7);
	CHECK("wrong_rkey", post(a, IBV_WR_RDMA_WRITE, mr, 0, 16, (uintptr_t)buf + 4096, mr->rkey ^ 0x00ff0000) == 0 &&
	      poll1(cq, &wc) == 1 && wc.status == IBV_WC_REM_ACCESS_ERR, "status %s",
	      ibv_wc_status_str(wc.status));
	/* The responder QP, moved to the error state by the access it refused, says so. */
	CHECK("qp_access_err_event", wait_event(IBV_EVENT_QP_ACCESS_ERR, b), "no IBV_EVENT_QP_ACCESS_ERR on the responder");
	while (ibv_poll_cq(cq, 1, &wc) > 0)
		;
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);

	pair(&a, &b, 0);
	CHECK("rnr_retry_exceeded", post(a, IBV_WR_SEND, mr, 0, 8, 0, 0) == 0 && poll1(cq, &wc) == 1 &&
	      wc.status == IBV_WC_RNR_RETRY_EXC_ERR, "status %s", ibv_wc_status_str(wc.status));
	while (ibv_poll_cq(cq, 1, &wc) > 0)
		;
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);

	{
		struct ibv_srq_init_attr si = { .attr = { .max_wr = 8, .max_sge = 1 } };
		struct ibv_srq *srq = ibv_create_srq(pd, &si);
		CHECK("create_srq", srq != NULL, "errno %d", errno);
		for (int i = 0; i < 4; i++) {
			struct ibv_sge s = { .addr = (uintptr_t)buf + 4096 + 64 * i, .length = 64, .lkey = mr->lkey };
			struct ibv_recv_wr r = { .wr_id = 100 + i, .sg_list = &s, .num_sge = 1 }, *bad;
			ibv_post_srq_recv(srq, &r, &bad);
		}
		struct ibv_srq_attr sa = { .srq_limit = 3 };
		CHECK("arm_srq_limit", ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT) == 0, "refused");
		struct ibv_qp *x = rc_qp(NULL), *y = rc_qp(srq);
		if (!x || !y || to_init(x) || to_init(y) || to_rts(x, y->qp_num, 7) || to_rts(y, x->qp_num, 7)) {
			printf("FAIL srq setup (errno %d)\n", errno);
			return 1;
		}
		post(x, IBV_WR_SEND, mr, 0, 8, 0, 0);
		post(x, IBV_WR_SEND, mr, 0, 8, 0, 0);
		int c = 0;
		double end = now() + 5;
		while (c < 4 && now() < end)
			c += ibv_poll_cq(cq, 1, &wc) > 0;
		CHECK("srq_limit_event", c == 4 && wait_event(IBV_EVENT_SRQ_LIMIT_REACHED, srq),
		      "%d completions, no event", c);
		CHECK("destroy_busy_srq", ibv_destroy_srq(srq) == EBUSY, "an SRQ in use was destroyed");
		/* A QP of an SRQ moved to the error state takes no more of its receives, and says so. */
		struct ibv_qp_attr ea = { .qp_state = IBV_QPS_ERR };
		CHECK("last_wqe_reached", ibv_modify_qp(y, &ea, IBV_QP_STATE) == 0 &&
		      wait_event(IBV_EVENT_QP_LAST_WQE_REACHED, y), "no IBV_EVENT_QP_LAST_WQE_REACHED");
		ibv_destroy_qp(x);
		ibv_destroy_qp(y);
		CHECK("destroy_srq", ibv_destroy_srq(srq) == 0, "refused");
	}
	{
		/* More completions than a CQ holds: polling it fails and IBV_EVENT_CQ_ERR names it. */
		struct ibv_cq *big = cq;
		cq = ibv_create_cq(ctx, 1, NULL, NULL, 0);
		CHECK("small_cq", cq != NULL, "errno %d", errno);
		pair(&a, &b, 7);
		/* The CQ of one entry holds at most 3 (rounded up as a hardware HCA may); 4 overrun it. */
		for (int i = 0; i < 4; i++)
			post(a, IBV_WR_RDMA_WRITE, mr, 0, 8, (uintptr_t)buf + 4096, mr->rkey);
		double end = now() + 5;
		int r = 0;
		while (now() < end && (r = ibv_poll_cq(cq, 1, &wc)) == 0)
			;
		/* Completions up to the CQ's size may come first; then the overrun. */
		while (r > 0 && now() < end)
			r = ibv_poll_cq(cq, 1, &wc);
		CHECK("cq_overrun", r < 0 && wait_event(IBV_EVENT_CQ_ERR, cq), "poll gave %d, or no IBV_EVENT_CQ_ERR", r);
		ibv_destroy_qp(a);
		ibv_destroy_qp(b);
		CHECK("destroy_overrun_cq", ibv_destroy_cq(cq) == 0, "refused");
		cq = big;
	}
	{
		/* NULLs where rdma-core checks them. */
		errno = 0;
		CHECK("null_pd", ibv_alloc_pd(NULL) == NULL && ibv_dealloc_pd(NULL) == EINVAL, "accepted");
		struct ibv_qp_init_attr none = { 0 };
		errno = 0;
		CHECK("qp_without_cqs", ibv_create_qp(pd, &none) == NULL && errno == EINVAL, "errno %d", errno);
		errno = 0;
		CHECK("cq_of_no_entries", ibv_create_cq(ctx, 0, NULL, NULL, 0) == NULL && errno == EINVAL,
		      "errno %d", errno);
	}
	CHECK("destroy_busy_channel", ibv_destroy_comp_channel(ch) == EBUSY, "a channel in use was destroyed");
	CHECK("teardown", ibv_destroy_cq(cq) == 0 && ibv_destroy_comp_channel(ch) == 0 && ibv_dereg_mr(mr) == 0 &&
	      ibv_dereg_mr(ro) == 0 && ibv_dealloc_pd(pd) == 0 && ibv_close_device(ctx) == 0, "refused");
	printf("all ok\n");
	return 0;
}
