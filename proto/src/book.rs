//! The address book: every peer's address as it published it through the bootstrap, read the
//! first time this process talks to that peer (or all at open, where the launcher keeps no
//! key-value space after it), and the handle the fabric makes from it (an InfiniBand address
//! handle, a libfabric `fi_addr_t`), made once. Four bytes for a rank never talked to
//! ([`PeerTable`]).
//!
//! An address is published under `"{component}.{rank}"` ([`key`]) before the bootstrap's fence
//! at open, as text (`Display`) that parses back (`FromStr`).

use std::fmt::Display;
use std::str::FromStr;
use std::sync::Arc;
use weft_provider::bootstrap::{Bootstrap, KvSpace};
use weft_provider::peers::PeerTable;
use weft_provider::{Error, Rank, Result};

/// The key rank `r`'s address is published under.
pub fn key(component: &str, r: Rank) -> String {
    format!("{component}.{r}")
}

/// One rank's entry.
#[derive(Debug, Clone, Copy)]
struct Entry<A, H> {
    addr: Option<A>,
    handle: Option<H>,
}

impl<A, H> Default for Entry<A, H> {
    fn default() -> Self {
        Entry {
            addr: None,
            handle: None,
        }
    }
}

/// Peers' addresses `A` and the handles `H` made from them, by rank.
pub struct AddressBook<A, H = ()> {
    component: &'static str,
    kv: Option<Arc<dyn KvSpace>>,
    entries: PeerTable<Entry<A, H>>,
}

impl<A, H> std::fmt::Debug for AddressBook<A, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AddressBook")
            .field("component", &self.component)
            .field("ranks", &self.entries.len())
            .field("looked_up", &self.entries.touched())
            .finish()
    }
}

impl<A, H> AddressBook<A, H>
where
    A: Copy + FromStr,
    A::Err: Display,
    H: Copy,
{
    /// Publish this process's address `me` (before the bootstrap's fence).
    pub fn publish(
        boot: &mut dyn Bootstrap,
        component: &'static str,
        me: &impl Display,
    ) -> Result<()> {
        let r = boot.rank();
        boot.put(&key(component, r), &me.to_string())
    }

    /// A book of `size` ranks that knows no address and has no way to learn one (a place
    /// holder until [`AddressBook::open`]).
    pub fn empty(component: &'static str, size: u32) -> Self {
        AddressBook {
            component,
            kv: None,
            entries: PeerTable::new(size as usize),
        }
    }

    /// The book of a job, after the fence that made every address visible: with the
    /// bootstrap's key-value space kept for later look-ups, or every address read now where
    /// the bootstrap keeps none.
    pub fn open(boot: &mut dyn Bootstrap, component: &'static str) -> Result<Self> {
        let size = boot.size();
        let mut book = AddressBook {
            component,
            kv: boot.kv(),
            entries: PeerTable::new(size as usize),
        };
        if book.kv.is_none() {
            for r in 0..size {
                let v = boot.get(&key(component, r))?;
                book.entries[r as usize].addr = Some(book.parse(r, &v)?);
            }
        }
        Ok(book)
    }

    fn parse(&self, r: Rank, v: &str) -> Result<A> {
        v.parse().map_err(|e| {
            Error::invalid(format!(
                "{}: rank {r} published an address that does not parse ({v:?}): {e}",
                self.component
            ))
        })
    }

    /// Rank `r`'s address.
    #[inline]
    pub fn get(&mut self, r: Rank) -> Result<A> {
        match self.entries.get(r as usize) {
            Some(Entry { addr: Some(a), .. }) => Ok(*a),
            Some(_) => self.look_up(r),
            None => Err(Error::invalid(format!(
                "{}: rank {r} is not in the job of {}",
                self.component,
                self.entries.len()
            ))),
        }
    }

    #[cold]
    fn look_up(&mut self, r: Rank) -> Result<A> {
        let kv = self
            .kv
            .as_ref()
            .ok_or_else(|| Error::invalid(format!("{}: no key-value space", self.component)))?;
        let v = kv.get(&key(self.component, r))?.ok_or_else(|| {
            Error::invalid(format!("{}: rank {r} published no address", self.component))
        })?;
        let a = self.parse(r, &v)?;
        self.entries[r as usize].addr = Some(a);
        Ok(a)
    }

    /// Rank `r`'s handle and address, the handle made by `make` from the address the first
    /// time (a failed `make` is tried again at the next call).
    #[inline]
    pub fn handle(&mut self, r: Rank, make: impl FnOnce(&A) -> Result<H>) -> Result<(H, A)> {
        if let Some(Entry {
            addr: Some(a),
            handle: Some(h),
        }) = self.entries.get(r as usize)
        {
            return Ok((*h, *a));
        }
        let a = self.get(r)?;
        let h = make(&a)?;
        self.entries[r as usize].handle = Some(h);
        Ok((h, a))
    }

    /// The handles made so far (to release them at close).
    pub fn handles(&self) -> impl Iterator<Item = H> + '_ {
        self.entries.iter().filter_map(|(_, e)| e.handle)
    }

    /// Ranks the book covers.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it covers no rank.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes the book holds (four per rank, an entry per rank looked up).
    pub fn bytes(&self) -> usize {
        self.entries.bytes()
    }

    /// Bytes a rank never looked up costs.
    pub const PER_RANK: usize = 4;

    /// Bytes a rank looked up costs besides.
    pub const PER_ENTRY: usize = std::mem::size_of::<Entry<A, H>>();
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_provider::bootstrap::InProcessJob;

    #[derive(Debug, Clone, Copy, PartialEq)]
    struct Addr(u32);
    impl FromStr for Addr {
        type Err = std::num::ParseIntError;
        fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
            s.strip_prefix("a").unwrap_or(s).parse().map(Addr)
        }
    }
    impl Display for Addr {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "a{}", self.0)
        }
    }

    /// Three ranks publish; each looks two up, makes a handle once, and is refused a rank
    /// past the job and an address that does not parse.
    #[test]
    fn addresses_are_looked_up_once_and_handles_made_once() {
        let job = InProcessJob::new(3, std::time::Duration::from_secs(20));
        let hs: Vec<_> = (0..3u32)
            .map(|r| {
                let job = job.clone();
                std::thread::spawn(move || {
                    let mut boot = job.rank(r);
                    AddressBook::<Addr, u64>::publish(&mut boot, "t", &Addr(100 + r)).unwrap();
                    boot.put("bad.0", "zz").unwrap();
                    boot.fence().unwrap();
                    let mut b = AddressBook::<Addr, u64>::open(&mut boot, "t").unwrap();
                    let empty = b.bytes();
                    for p in 0..3 {
                        assert_eq!(b.get(p).unwrap(), Addr(100 + p));
                    }
                    let mut made = 0;
                    for _ in 0..3 {
                        let (h, a) = b
                            .handle((r + 1) % 3, |a| {
                                made += 1;
                                Ok(u64::from(a.0) * 2)
                            })
                            .unwrap();
                        assert_eq!(
                            (h, a),
                            (u64::from(100 + (r + 1) % 3) * 2, Addr(100 + (r + 1) % 3))
                        );
                    }
                    assert_eq!(made, 1, "the handle is made once");
                    assert!(b.handle(r, |_| Err(Error::invalid("no"))).is_err());
                    assert!(b.get(3).unwrap_err().to_string().contains("not in the job"));
                    assert!(b.bytes() > empty);
                    let mut bad = AddressBook::<Addr, ()>::open(&mut boot, "bad").unwrap();
                    let e = bad.get(0).unwrap_err().to_string();
                    assert!(e.contains("does not parse"), "{e}");
                    assert!(bad.get(1).unwrap_err().to_string().contains("published no"));
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    }
}
