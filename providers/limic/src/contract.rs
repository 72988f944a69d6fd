//! `Limic` as a weft provider: the contract's entry points, opening by name and the teardown.

use super::*;

impl Drop for Limic {
    fn drop(&mut self) {
        self.seg.area(self.me).live.set_closed();
    }
}

impl Provider for Limic {
    fn name(&self) -> &str {
        "limic"
    }
    fn caps(&self) -> &Caps {
        &self.caps
    }
    fn rank(&self) -> Rank {
        self.me as Rank
    }
    fn size(&self) -> u32 {
        self.size
    }

    fn am_send(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        let d = dest as usize;
        self.check_dest(d)?;
        let plen: usize = payload.iter().map(|p| p.len()).sum();
        if header.len() > AM_HEADER_MAX || plen > self.seg.lay.am_payload {
            return Err(Error::invalid(format!(
                "limic: active message of {} + {plen} bytes exceeds {AM_HEADER_MAX} + {}",
                header.len(),
                self.seg.lay.am_payload
            )));
        }
        let area = self.seg.area(d);
        let _g = lock(&area.am_lock, self.me, self.alive_fn());
        let tail = area.am_tail.tail.load(Ordering::Relaxed);
        let head = area.am_head.v.load(Ordering::Acquire);
        if tail - head >= self.seg.lay.am_cells as u64 {
            return Ok(SendOutcome::Busy);
        }
        let c = self.seg.cell(d, tail as usize);
        // SAFETY: cell `tail` is free (the consumer is past it) and only we, holding the
        // producers' lock, write it; sizes were checked against the cell.
        unsafe {
            (c as *mut u32).write_unaligned(self.me as u32);
            (c.add(4) as *mut u32).write_unaligned(header.len() as u32);
            (c.add(8) as *mut u32).write_unaligned(plen as u32);
            std::ptr::copy_nonoverlapping(header.as_ptr(), c.add(CELL_HDR), header.len());
            let mut at = c.add(CELL_HDR + AM_HEADER_MAX);
            for p in payload {
                std::ptr::copy_nonoverlapping(p.as_ptr(), at, p.len());
                at = at.add(p.len());
            }
        }
        area.am_tail.tail.store(tail + 1, Ordering::Release);
        Ok(SendOutcome::Sent)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut n = self.reap();
        if !self.deferred_sends.is_empty() || !self.deferred_recvs.is_empty() {
            n += self.run_deferred()?;
        }
        n += self.done.deliver(sink);
        n += self.drain_am(sink);
        if n == 0 {
            self.idle_polls += 1;
            if self.idle_polls >= 256 {
                self.idle_polls = 0;
                let now = Instant::now();
                if now - self.last_check >= LIVENESS_EVERY {
                    self.last_check = now;
                    n += self.check_peers(sink);
                    n += self.done.deliver(sink);
                }
            }
        } else {
            self.idle_polls = 0;
        }
        Ok(n)
    }

    fn close(&mut self) -> Result<()> {
        self.seg.area(self.me).live.set_closed();
        if self.abandoned > 0 {
            tracing::debug!(
                slots = self.abandoned,
                "limic: slots given up with failed peers"
            );
        }
        Ok(())
    }

    unsafe fn tagged_send(
        &mut self,
        dest: Rank,
        ctx: u32,
        tag: i32,
        data: &[RawIov],
        sync: bool,
        token: Token,
    ) -> Result<()> {
        let d = dest as usize;
        self.check_dest(d)?;
        self.post(Deferred::Send {
            dest: d,
            ctx,
            tag,
            iov: ranges_of(data),
            sync,
            token,
        })
    }

    unsafe fn tagged_recv(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
        buf: &[RawIovMut],
        token: Token,
    ) -> Result<()> {
        let s = src.map(|r| r as usize);
        if let Some(r) = s {
            if r >= self.size as usize {
                return self.check_dest(r);
            }
        }
        self.post(Deferred::Recv {
            src: s,
            ctx,
            tag,
            iov: ranges_of_mut(buf),
            token,
        })
    }

    fn tagged_probe(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
    ) -> Result<Option<TaggedStatus>> {
        let me = self.me;
        let _g = lock_area(&self.seg, &self.watch, me, me);
        let want_tag = tag.map_or(ANY_TAG, |t| t as i64);
        let hit = self.seg.find(me, Q::Unexp, |r, s| {
            s.ctx.load(Ordering::Relaxed) == ctx
                && src.is_none_or(|w| r == w as usize)
                && tag_matches(want_tag, s.tag.load(Ordering::Relaxed))
        });
        Ok(hit.map(|sr| {
            let (r, i) = sref_parts(sr);
            let s = self.seg.slot(r, i);
            TaggedStatus {
                source: r as Rank,
                tag: s.tag.load(Ordering::Relaxed) as i32,
                bytes: s.len.load(Ordering::Relaxed) as usize,
            }
        }))
    }

    fn tagged_cancel(&mut self, token: Token) -> Result<bool> {
        // Still waiting for a slot: just forget it.
        if let Some(k) = self
            .deferred_recvs
            .iter()
            .position(|d| matches!(d, Deferred::Recv { token: t, .. } if *t == token))
        {
            self.deferred_recvs.remove(k);
            return Ok(true);
        }
        let Some(k) = self
            .out
            .iter()
            .position(|o| o.token == Some(token) && o.kind == RECV)
        else {
            return Ok(false);
        };
        let slot = self.out[k].slot;
        let me = self.me;
        let _g = lock_area(&self.seg, &self.watch, me, me);
        let target = sref(me, slot);
        let mut removed = false;
        // Only a receive still in the posted queue can be cancelled; a claimed one completes.
        if self.seg.slot(me, slot).state.load(Ordering::Relaxed) == POSTED {
            let mine = self.seg.slot(me, slot);
            removed = self
                .seg
                .take_first(me, Q::Posted, |s| std::ptr::eq(s, mine))
                .is_some_and(|r| r == target);
        }
        if removed {
            self.seg.slot(me, slot).state.store(FREE, Ordering::Relaxed);
            self.out.swap_remove(k);
            self.free.push(slot);
        }
        Ok(removed)
    }

    unsafe fn mr_register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        let key = (1 << 62) | self.next_key;
        self.next_key += 1;
        self.register(base, len, access, key, false)
    }

    unsafe fn mr_register_keyed(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
        key: u64,
    ) -> Result<MemRegion> {
        if key == 0 || key & (1 << 62) != 0 {
            return Err(Error::invalid(format!("limic: key {key} is reserved")));
        }
        self.register(base, len, access, key, true)
    }

    fn mr_deregister(&mut self, mr: &MemRegion) -> Result<()> {
        let area = self.seg.area(self.me);
        if let Some(reg) = area.regions.get(mr.handle as usize) {
            if reg.key.load(Ordering::Relaxed) == mr.key {
                reg.key.store(0, Ordering::SeqCst);
            }
        }
        // A peer that looked the region up before the key went may still be copying: wait
        // until no live peer announces an access to this rank's regions. (Each side stores,
        // then loads the other's word, sequentially consistent: one of them sees the other.)
        let mine = self.me as u64 + 1;
        for r in 0..self.size as usize {
            if r == self.me {
                continue;
            }
            let word = &self.seg.area(r).rma_access.v;
            let mut spins = 0u32;
            while word.load(Ordering::SeqCst) == mine {
                spins += 1;
                if spins % 256 == 0 && self.watch.gone(r, &self.seg.area(r).live).is_some() {
                    break;
                }
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    unsafe fn rma_read(
        &mut self,
        src: Rank,
        local: &[RawIovMut],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.one_sided(src, Dir::Pull, &ranges_of_mut(local), remote, done)
    }

    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.one_sided(dest, Dir::Push, &ranges_of(local), remote, done)
    }

    fn cntr_open(&mut self) -> Result<CntrId> {
        Ok(self.done.open())
    }

    fn cntr_read(&mut self, cntr: CntrId) -> Result<CntrValue> {
        self.done.read(cntr)
    }

    fn cntr_close(&mut self, cntr: CntrId) -> Result<()> {
        self.done.close(cntr)
    }
}

impl StaticProvider for Limic {
    const NAME: &'static str = "limic";

    fn probe(ctx: &ProbeContext) -> std::result::Result<(), String> {
        if ctx.in_process {
            return Err("ranks are threads of one process; limic joins processes".into());
        }
        if ctx.hosts > 1 {
            return Err(format!(
                "the job spans {} hosts; cross-memory attach reaches only one host",
                ctx.hosts
            ));
        }
        if let Ok(v) = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
            if v.trim() == "3" {
                return Err("Yama ptrace_scope is 3: cross-memory attach is disabled".into());
            }
        }
        Config::from_env().map(|_| ()).map_err(|e| e.to_string())
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        Self::open_with(boot, &Config::from_env()?)
    }

    fn static_caps() -> Result<Caps> {
        Config::from_env()?;
        let mut c = caps();
        c.eager_limit = AM_PAYLOAD;
        Ok(c)
    }
}
