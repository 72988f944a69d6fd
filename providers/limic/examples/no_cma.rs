//! `no_cma PROGRAM ARGS...`: run a program with cross-memory attach forbidden, as container
//! runtimes' default seccomp profiles do: `process_vm_readv` and `process_vm_writev` fail with
//! EPERM. Tests use it to check that limic reports itself unavailable and selection moves on.

use std::os::unix::process::CommandExt;

#[repr(C)]
struct SockFilter {
    code: u16,
    jt: u8,
    jf: u8,
    k: u32,
}

#[repr(C)]
struct SockFprog {
    len: u16,
    filter: *const SockFilter,
}

const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JEQ_K: u16 = 0x15;
const BPF_RET_K: u16 = 0x06;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        eprintln!("usage: no_cma PROGRAM [ARGS...]");
        std::process::exit(2);
    }
    let eperm = SECCOMP_RET_ERRNO | libc::EPERM as u32;
    let prog = [
        // A = seccomp_data.nr
        SockFilter {
            code: BPF_LD_W_ABS,
            jt: 0,
            jf: 0,
            k: 0,
        },
        SockFilter {
            code: BPF_JEQ_K,
            jt: 2,
            jf: 0,
            k: libc::SYS_process_vm_readv as u32,
        },
        SockFilter {
            code: BPF_JEQ_K,
            jt: 1,
            jf: 0,
            k: libc::SYS_process_vm_writev as u32,
        },
        SockFilter {
            code: BPF_RET_K,
            jt: 0,
            jf: 0,
            k: SECCOMP_RET_ALLOW,
        },
        SockFilter {
            code: BPF_RET_K,
            jt: 0,
            jf: 0,
            k: eperm,
        },
    ];
    let fprog = SockFprog {
        len: prog.len() as u16,
        filter: prog.as_ptr(),
    };
    // SAFETY: prctl calls with valid arguments; the filter program outlives the call (the
    // kernel copies it).
    unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
            || libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &fprog as *const SockFprog,
            ) != 0
        {
            eprintln!(
                "no_cma: installing the seccomp filter: {}",
                std::io::Error::last_os_error()
            );
            std::process::exit(2);
        }
    }
    let e = std::process::Command::new(&args[0]).args(&args[1..]).exec();
    eprintln!("no_cma: {}: {e}", args[0]);
    std::process::exit(127);
}
