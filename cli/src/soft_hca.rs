//! `weft soft-hca`: the soft HCA as a drop-in `libibverbs.so.1` for unmodified programs.
//!
//! `env` installs the library and prints the `LD_LIBRARY_PATH` line; that is all rdma-core's
//! examples and perftest need. `exec` also gives the program the device node a kernel RDMA
//! stack would have made: UCX (`uct_ib_device_is_accessible` in `uct/ib/base/ib_device.c`)
//! lists a verbs device only if `/dev/infiniband/<dev_name>` is a character device it may
//! read and write, and this machine has no `/dev/infiniband` at all. `exec` runs the program
//! in a private mount namespace whose `/dev` is a fresh tmpfs holding bind mounts of every
//! entry of the real `/dev` (so `/dev/shm`, `/dev/pts`, `/dev/null` are the host's own) plus
//! `infiniband/uverbs-weft0`, a bind mount of `/dev/null`: nothing opens it (the drop-in's
//! `ibv_open_device` does not), it only has to pass the check. Nothing outside the namespace
//! changes and nothing is left behind: the namespace goes when its last process ends.

use std::ffi::{CString, OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

/// The node UCX looks for: "/dev/infiniband/" + the drop-in's `ibv_device::dev_name`
/// (`export/ibverbs/src/lib.rs`).
pub const DEV_NODE: &str = "uverbs-weft0";

/// Install the drop-in libibverbs.so.1 (built by `cargo build -p weft-ibverbs` next to this
/// program, or named by WEFT_IBVERBS_LIB) into `dir` (default: `soft-hca/` next to this
/// program); returns the directory.
pub fn install(dir: Option<PathBuf>) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("where am I: {e}"))?;
    let here = exe.parent().ok_or("this program has no directory")?;
    let lib = match std::env::var_os("WEFT_IBVERBS_LIB") {
        Some(p) => PathBuf::from(p),
        None => here.join("libweft_ibverbs.so"),
    };
    if !lib.is_file() {
        return Err(format!(
            "{} is missing: build it with `cargo build -p weft-ibverbs` (the profile of this \
             program), or name it with WEFT_IBVERBS_LIB",
            lib.display()
        ));
    }
    let dir = dir.unwrap_or_else(|| here.join("soft-hca"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let dir = dir
        .canonicalize()
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let dst = dir.join("libibverbs.so.1");
    // A copy beside, then a rename: a program running with the old file keeps its mapping.
    let tmp = dir.join(format!(".libibverbs.so.1.{}", std::process::id()));
    std::fs::copy(&lib, &tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &dst).map_err(|e| format!("{}: {e}", dst.display()))?;
    Ok(dir)
}

/// `weft soft-hca env`: install, then the shell lines that point programs at the drop-in.
pub fn env(dir: Option<PathBuf>) -> Result<String, String> {
    let dir = install(dir)?;
    Ok(format!(
        "# weft's soft HCA as libibverbs.so.1: device weft0, one RoCE-style port (address by \
         GID: rdma-core's examples take -g 0)\n\
         export LD_LIBRARY_PATH={}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\n\
         # programs that also need /dev/infiniband (UCX): weft soft-hca exec -- PROGRAM ...\n",
        dir.display()
    ))
}

/// `weft soft-hca exec -- PROGRAM ARGS...`: install, make the device node in a private mount
/// namespace, then become PROGRAM with the drop-in on `LD_LIBRARY_PATH`. Returns only on
/// failure.
pub fn exec(dir: Option<PathBuf>, command: &[OsString]) -> String {
    let Some((prog, args)) = command.split_first() else {
        return "no program given (weft soft-hca exec -- PROGRAM ARGS...)".into();
    };
    let dir = match install(dir) {
        Ok(d) => d,
        Err(e) => return e,
    };
    if let Err(e) = private_dev() {
        return e;
    }
    let mut path = OsString::from(dir.as_os_str());
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(old);
    }
    let e = std::process::Command::new(prog)
        .args(args)
        .env("LD_LIBRARY_PATH", path)
        .exec();
    format!("{}: {e}", prog.to_string_lossy())
}

fn cstr(p: &Path) -> Result<CString, String> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| format!("{}: a NUL in the path", p.display()))
}

/// mount(2) with the error as a sentence.
fn mount(
    src: Option<&Path>,
    dst: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), String> {
    let src_c = src.map(cstr).transpose()?;
    let dst_c = cstr(dst)?;
    let fs_c = fstype.map(|f| CString::new(f).expect("a literal without NUL"));
    let data_c = data.map(|d| CString::new(d).expect("a literal without NUL"));
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is NULL or a NUL-terminated string owned by this frame and alive
    // across the call; mount(2) reads them and keeps none.
    let r = unsafe {
        libc::mount(
            ptr(&src_c),
            dst_c.as_ptr(),
            ptr(&fs_c),
            flags,
            ptr(&data_c).cast(),
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(format!(
            "mount {} on {}: {}",
            src.map_or_else(
                || fstype.unwrap_or("-").to_string(),
                |s| s.display().to_string()
            ),
            dst.display(),
            std::io::Error::last_os_error()
        ))
    }
}

/// Bind `src` (anything but a symbolic link) onto a new entry `dst` of the same kind.
fn bind_entry(src: &Path, dst: &Path, is_dir: bool) -> Result<(), String> {
    let made = if is_dir {
        std::fs::create_dir(dst)
    } else {
        std::fs::File::create(dst).map(drop)
    };
    made.map_err(|e| format!("{}: {e}", dst.display()))?;
    mount(Some(src), dst, None, libc::MS_BIND | libc::MS_REC, None)
}

/// Copy `from` (a directory of the real `/dev`) into `to` entry by entry: symbolic links as
/// links, everything else as a bind mount.
fn mirror(from: &Path, to: &Path, skip: Option<&OsStr>) -> Result<(), String> {
    let entries = std::fs::read_dir(from).map_err(|e| format!("{}: {e}", from.display()))?;
    for e in entries {
        let e = e.map_err(|e| format!("{}: {e}", from.display()))?;
        if Some(e.file_name().as_os_str()) == skip {
            continue;
        }
        let (src, dst) = (e.path(), to.join(e.file_name()));
        let t = e
            .file_type()
            .map_err(|e| format!("{}: {e}", src.display()))?;
        if t.is_symlink() {
            let target = std::fs::read_link(&src).map_err(|e| format!("{}: {e}", src.display()))?;
            std::os::unix::fs::symlink(target, &dst)
                .map_err(|e| format!("{}: {e}", dst.display()))?;
        } else {
            bind_entry(&src, &dst, t.is_dir())?;
        }
    }
    Ok(())
}

/// Enter a private mount namespace whose `/dev` has `infiniband/uverbs-weft0` (see the
/// module comment).
fn private_dev() -> Result<(), String> {
    // SAFETY: unshare(2) takes a flag word and touches no memory of ours. It moves this
    // process (and what it starts) to a copy of the mount table; no other thread depends on
    // the old one.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(format!(
            "a private mount namespace for /dev/infiniband/{DEV_NODE}: {} (it needs \
             CAP_SYS_ADMIN: run as root; programs that do not look for the node, such as \
             rdma-core's examples and perftest, need only `weft soft-hca env`)",
            std::io::Error::last_os_error()
        ));
    }
    // Nothing mounted from here on propagates back to the host's namespace.
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )?;
    let dev = Path::new("/dev");
    let stage = std::env::temp_dir().join(format!("weft-soft-hca-dev.{}", std::process::id()));
    std::fs::create_dir(&stage).map_err(|e| format!("{}: {e}", stage.display()))?;
    let built = (|| {
        mount(
            None,
            &stage,
            Some("tmpfs"),
            libc::MS_NOSUID,
            Some("mode=755,size=64k"),
        )?;
        let ib = OsStr::new("infiniband");
        mirror(dev, &stage, Some(ib))?;
        let ib_dir = stage.join(ib);
        std::fs::create_dir(&ib_dir).map_err(|e| format!("{}: {e}", ib_dir.display()))?;
        // A host that has a real /dev/infiniband keeps its nodes beside weft's.
        if dev.join(ib).is_dir() {
            mirror(&dev.join(ib), &ib_dir, Some(OsStr::new(DEV_NODE)))?;
        }
        bind_entry(&dev.join("null"), &ib_dir.join(DEV_NODE), false)?;
        mount(Some(&stage), dev, None, libc::MS_MOVE, None)
    })();
    if built.is_err() {
        // Half-built: detach whatever is still mounted on the staging directory.
        if let Ok(c) = cstr(&stage) {
            // SAFETY: `c` is a NUL-terminated path alive across the call.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
    // Moved (or detached): the staging directory is an empty directory again.
    let _ = std::fs::remove_dir(&stage);
    built
}
