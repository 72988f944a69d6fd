//! `Box<dyn Provider>` (the dynamic path) is a provider: every method forwards.

use super::*;

impl<T: Provider + ?Sized> Provider for Box<T> {
    #[inline]
    fn name(&self) -> &str {
        (**self).name()
    }
    #[inline]
    fn caps(&self) -> &Caps {
        (**self).caps()
    }
    #[inline]
    fn rank(&self) -> Rank {
        (**self).rank()
    }
    #[inline]
    fn size(&self) -> u32 {
        (**self).size()
    }
    #[inline]
    fn am_send(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        (**self).am_send(dest, header, payload)
    }
    #[inline]
    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        (**self).progress(sink)
    }
    fn close(&mut self) -> Result<()> {
        (**self).close()
    }
    fn connect(&mut self, peer: Rank) -> Result<()> {
        (**self).connect(peer)
    }
    #[inline]
    fn peer_caps(&self, peer: Rank) -> Option<PeerCaps> {
        (**self).peer_caps(peer)
    }
    fn counters(&self) -> Vec<(&'static str, u64)> {
        (**self).counters()
    }
    #[inline]
    unsafe fn am_isend(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[RawIov],
        token: Token,
    ) -> Result<SendOutcome> {
        (**self).am_isend(dest, header, payload, token)
    }
    unsafe fn mr_register_iov(&mut self, iov: &[RawIovMut], access: Access) -> Result<MemRegion> {
        (**self).mr_register_iov(iov, access)
    }
    unsafe fn rma_write_data(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        data: u64,
        done: Completion,
    ) -> Result<()> {
        (**self).rma_write_data(dest, local, remote, data, done)
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
        (**self).tagged_send(dest, ctx, tag, data, sync, token)
    }
    unsafe fn tagged_recv(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
        buf: &[RawIovMut],
        token: Token,
    ) -> Result<()> {
        (**self).tagged_recv(src, ctx, tag, buf, token)
    }
    fn tagged_probe(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
    ) -> Result<Option<TaggedStatus>> {
        (**self).tagged_probe(src, ctx, tag)
    }
    fn tagged_cancel(&mut self, token: Token) -> Result<bool> {
        (**self).tagged_cancel(token)
    }
    unsafe fn mr_register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        (**self).mr_register(base, len, access)
    }
    unsafe fn mr_register_keyed(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
        key: u64,
    ) -> Result<MemRegion> {
        (**self).mr_register_keyed(base, len, access, key)
    }
    fn mr_deregister(&mut self, mr: &MemRegion) -> Result<()> {
        (**self).mr_deregister(mr)
    }
    fn mem_alloc(&mut self, len: usize) -> Result<(*mut u8, MemRegion)> {
        (**self).mem_alloc(len)
    }
    fn mem_free(&mut self, ptr: *mut u8, mr: &MemRegion) -> Result<()> {
        (**self).mem_free(ptr, mr)
    }
    unsafe fn rma_read(
        &mut self,
        src: Rank,
        local: &[RawIovMut],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        (**self).rma_read(src, local, remote, done)
    }
    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        (**self).rma_write(dest, local, remote, done)
    }
    unsafe fn atomic(
        &mut self,
        dest: Rank,
        a: &AtomicOp,
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        (**self).atomic(dest, a, remote, done)
    }
    fn cntr_open(&mut self) -> Result<CntrId> {
        (**self).cntr_open()
    }
    #[inline]
    fn cntr_read(&mut self, cntr: CntrId) -> Result<CntrValue> {
        (**self).cntr_read(cntr)
    }
    fn cntr_close(&mut self, cntr: CntrId) -> Result<()> {
        (**self).cntr_close(cntr)
    }
    fn rma_try_lock(&mut self, target: Rank, window: RemoteAddr, exclusive: bool) -> Result<bool> {
        (**self).rma_try_lock(target, window, exclusive)
    }
    fn rma_unlock(&mut self, target: Rank, window: RemoteAddr, exclusive: bool) -> Result<()> {
        (**self).rma_unlock(target, window, exclusive)
    }
}
