//! The hybrid provider opens one device for both of its channels, as a process has one HCA:
//! the channels share its QP-context cache (the timing model's included) and its service
//! threads.

use weft_hybrid::Hybrid;
use weft_provider::bootstrap::{Bootstrap, Singleton};
use weft_provider::provider::StaticProvider;

/// The device part (GID) of the address a channel published for rank 0.
fn gid_of(boot: &mut Singleton, channel: &str) -> String {
    let ep = boot
        .get(&format!("{channel}.0"))
        .unwrap_or_else(|e| panic!("{channel} published no address: {e}"));
    ep.split(':').next().unwrap_or_default().to_string()
}

#[test]
fn both_channels_share_one_device() {
    // Two devices opened apart have two GIDs: the comparison below can tell them apart.
    let (d1, d2) = (
        weft_verbs::open_default().expect("open a device"),
        weft_verbs::open_default().expect("open a device"),
    );
    assert_ne!(d1.gid(), d2.gid());
    drop((d1, d2));

    let mut boot = Singleton::new();
    let h = Hybrid::open(&mut boot).expect("open hybrid");
    let (ud, rc) = (gid_of(&mut boot, "verbs-ud"), gid_of(&mut boot, "verbs-rc"));
    assert!(!ud.is_empty());
    assert_eq!(ud, rc, "verbs-ud and verbs-rc of one hybrid on two devices");
    drop(h);
}
