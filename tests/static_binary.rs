//! The binary runs in any app image (docs/pod-lifecycle.md): the app containers' hooks run it
//! from the pod's shared volume, in Debian, Alpine (musl), distroless/static or scratch
//! images alike. So it is fully static, and this test runs the very binary that the other
//! tests run (and that the image ships) in an empty chroot that holds only the binary, an
//! `/etc/hosts` and an `/etc/resolv.conf`: it starts, and proxies to targets named through
//! each of them. The chroot has a network namespace of its own, whose 127.0.0.1:53 is a small
//! DNS server of the test's.

#[path = "pod/kubelet.rs"]
#[allow(dead_code)]
mod kubelet;
mod support;

use std::io::Read;
use std::net::{Ipv4Addr, UdpSocket};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kubelet::{NetNs, http_status};
use support::BIN;
use support::backend::Backend;

#[test]
fn the_binary_is_static_no_interpreter_no_shared_library() {
    let elf = std::fs::read(BIN).unwrap();
    assert_eq!(&elf[..4], b"\x7fELF");
    // Program headers: PT_INTERP (3) names a program interpreter, PT_DYNAMIC (2) with
    // DT_NEEDED entries names shared libraries. A static-pie has PT_DYNAMIC (for its own
    // relocations) but no PT_INTERP and needs nothing.
    let u16_at = |at: usize| u16::from_le_bytes([elf[at], elf[at + 1]]) as usize;
    let u64_at = |at: usize| u64::from_le_bytes(elf[at..at + 8].try_into().unwrap()) as usize;
    assert_eq!(elf[4], 2, "64-bit ELF");
    let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    let mut dynamic = None;
    for index in 0..phnum {
        let header = phoff + index * phentsize;
        let kind = u32::from_le_bytes(elf[header..header + 4].try_into().unwrap());
        assert_ne!(
            kind, 3,
            "the binary names a program interpreter (PT_INTERP)"
        );
        if kind == 2 {
            dynamic = Some((u64_at(header + 8), u64_at(header + 32)));
        }
    }
    if let Some((offset, size)) = dynamic {
        for entry in (offset..offset + size).step_by(16) {
            let tag = u64_at(entry);
            assert_ne!(tag, 1, "the binary needs a shared library (DT_NEEDED)");
            if tag == 0 {
                break;
            }
        }
    }
}

/// A DNS server on 127.0.0.1:53 of the calling thread's network namespace: `A` records for
/// `names`, NXDOMAIN for anything else. Runs until `stop`.
fn dns_server(names: &'static [&'static str], stop: Arc<AtomicBool>) -> UdpSocket {
    let socket = UdpSocket::bind("127.0.0.1:53").unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let server = socket.try_clone().unwrap();
    std::thread::spawn(move || {
        let mut buf = [0u8; 512];
        while !stop.load(Ordering::SeqCst) {
            let Ok((len, peer)) = server.recv_from(&mut buf) else {
                continue;
            };
            if let Some(answer) = dns_answer(&buf[..len], names) {
                let _ = server.send_to(&answer, peer);
            }
        }
    });
    socket
}

fn dns_answer(query: &[u8], names: &[&str]) -> Option<Vec<u8>> {
    let mut at = 12;
    let mut labels = Vec::new();
    loop {
        let len = *query.get(at)? as usize;
        at += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(query.get(at..at + len)?).to_lowercase());
        at += len;
    }
    let qtype = u16::from_be_bytes([*query.get(at)?, *query.get(at + 1)?]);
    let question_end = at + 4;
    let name = labels.join(".");
    let known = names.contains(&name.as_str());
    let mut answer = query.get(..question_end)?.to_vec();
    answer[2] = 0x81; // response, recursion desired
    answer[3] = if known { 0x80 } else { 0x83 }; // recursion available; NXDOMAIN when unknown
    answer[6..8].copy_from_slice(&[0, u8::from(known && qtype == 1)]);
    answer[8..12].copy_from_slice(&[0, 0, 0, 0]);
    if known && qtype == 1 {
        answer.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
        answer.extend_from_slice(&Ipv4Addr::LOCALHOST.octets());
    }
    Some(answer)
}

#[test]
fn the_copied_binary_proxies_from_an_empty_chroot_to_names_from_hosts_and_dns() {
    let Some(netns) = NetNs::new("chroot") else {
        return support::skip(
            "the_copied_binary_proxies_from_an_empty_chroot",
            "cannot make a network namespace (needs root and ip(8))",
        );
    };
    let netns = Arc::new(netns);
    let root = std::env::temp_dir().join(format!("lameduck-chroot-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("etc")).unwrap();
    // As the pod's install step hands it over: `lameduck copy-binary`.
    let copied = Command::new(BIN)
        .args(["copy-binary"])
        .arg(root.join("lameduck"))
        .status()
        .unwrap();
    assert!(copied.success());
    std::fs::write(root.join("etc/hosts"), "127.0.0.1 hosts-backend.test\n").unwrap();
    std::fs::write(
        root.join("etc/resolv.conf"),
        "nameserver 127.0.0.1\noptions timeout:1 attempts:2\n",
    )
    .unwrap();
    let entries: Vec<_> = walk(&root);
    assert_eq!(
        entries,
        ["etc", "etc/hosts", "etc/resolv.conf", "lameduck"],
        "the chroot holds nothing else"
    );

    let backend = netns.run(Backend::start);
    let port = backend.addr.port();
    let stop = Arc::new(AtomicBool::new(false));
    let dns = {
        let stop = stop.clone();
        netns.run(move || dns_server(&["dns-backend.test"], stop))
    };
    let root_c = std::ffi::CString::new(root.as_os_str().as_encoded_bytes()).unwrap();
    let ns = netns.raw_fd();
    let mut proxy = Command::new("/lameduck");
    proxy
        .args([
            "--inbound",
            &format!("127.0.0.1:14143=hosts-backend.test:{port}"),
            "--inbound",
            &format!("127.0.0.1:14144=dns-backend.test:{port}"),
            "--admin",
            "127.0.0.1:14191",
        ])
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: only async-signal-safe system calls between fork and exec.
    unsafe {
        proxy.pre_exec(move || {
            if libc::setns(ns, libc::CLONE_NEWNET) != 0
                || libc::chroot(root_c.as_ptr()) != 0
                || libc::chdir(c"/".as_ptr()) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = proxy
        .spawn()
        .expect("start the copied binary in the chroot");
    let started = netns.run(|| {
        let deadline = Instant::now() + support::PATIENCE;
        while Instant::now() < deadline {
            if http_status(14191, "/ready") == Some(200) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    });
    let mut log = String::new();
    if !started {
        let _ = child.kill();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut log)
            .unwrap();
        panic!("the binary did not start in the chroot: {log}");
    }
    // A name from the DNS server that /etc/resolv.conf names.
    assert_eq!(
        netns.run(|| http_status(14144, "/through-dns")),
        Some(200),
        "dns-backend.test"
    );
    // A name from /etc/hosts. With no /etc/nsswitch.conf glibc asks DNS first and reads the
    // hosts file when no DNS server answers (a scratch image's case; distroless ships
    // "hosts: files dns"), so the DNS server goes away for this one.
    stop.store(true, Ordering::SeqCst);
    drop(dns);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        netns.run(|| http_status(14143, "/through-hosts")),
        Some(200),
        "hosts-backend.test"
    );
    let paths = backend.seen_paths();
    assert!(paths.contains(&"/through-dns".to_string()), "{paths:?}");
    assert!(paths.contains(&"/through-hosts".to_string()), "{paths:?}");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = support::wait_child(&mut child, support::PATIENCE);
    assert_eq!(status.code(), Some(0));
    let _ = std::fs::remove_dir_all(&root);
}

/// Every file and folder under `root`, relative, sorted.
fn walk(root: &std::path::Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            found.push(path.strip_prefix(root).unwrap().display().to_string());
            if path.is_dir() {
                todo.push(path);
            }
        }
    }
    found.sort();
    found
}
