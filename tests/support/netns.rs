//! Network namespaces of the tests' own (`ip netns`), for what must not touch the machine's:
//! fixed ports, NAT rules, interfaces.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::Arc;
use std::thread;

/// Runs a command (in the calling thread's network namespace); panics with its output unless
/// it succeeds.
pub fn run(program: &str, args: &[&str]) {
    let out = Command::new(program).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Why NAT rules cannot be written here, if they cannot: iptables-nft is not installed.
pub fn without_iptables() -> Option<&'static str> {
    let runs = Command::new("iptables-nft")
        .arg("--version")
        .output()
        .is_ok_and(|out| out.status.success());
    (!runs).then_some("iptables-nft is not installed (Debian package iptables)")
}

/// Runs `work` on a thread in a network namespace of the test's own, named after `test`; skips
/// the test (saying why) when `unsupported` says this machine cannot run it, or when no
/// namespace can be made.
pub fn in_netns(
    test: &'static str,
    unsupported: Option<&'static str>,
    work: impl FnOnce() + Send + 'static,
) {
    if let Some(why) = unsupported {
        return super::skip(test, why);
    }
    // The test's name in the namespace's: tests run in parallel.
    let tag: String = test.split('_').map(|word| &word[..1]).collect();
    let Some(netns) = NetNs::new(&tag) else {
        return super::skip(
            test,
            "cannot make a network namespace (needs root and ip(8))",
        );
    };
    Arc::new(netns).run(work);
}

/// A network namespace of the test's own, deleted on drop.
pub struct NetNs {
    name: String,
    file: File,
}

impl NetNs {
    /// None when network namespaces cannot be made here (not root, no iproute2).
    pub fn new(tag: &str) -> Option<NetNs> {
        let name = format!("lameduck-{tag}-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        let made = Command::new("ip")
            .args(["netns", "add", &name])
            .output()
            .ok()?;
        if !made.status.success() {
            return None;
        }
        let up = Command::new("ip")
            .args(["-n", &name, "link", "set", "lo", "up"])
            .status()
            .ok()?;
        let file = File::open(format!("/var/run/netns/{name}")).ok()?;
        let netns = NetNs { name, file };
        up.success().then_some(netns)
    }

    /// Its name, for `ip -n NAME` and `ip link set … netns NAME`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace's descriptor, for `setns` in a child before it runs a program.
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }

    /// Moves the calling thread into the namespace (threads it spawns follow it).
    pub fn enter(&self) {
        // SAFETY: setns(2) on a descriptor we own; it changes only this thread.
        let rc = unsafe { libc::setns(self.file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
    }

    /// Runs `work` on a thread inside the namespace.
    pub fn spawn<T: Send + 'static>(
        self: &Arc<Self>,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> thread::JoinHandle<T> {
        let netns = self.clone();
        thread::spawn(move || {
            netns.enter();
            work()
        })
    }

    /// Runs `work` inside the namespace and returns what it returns.
    pub fn run<T: Send + 'static>(
        self: &Arc<Self>,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        self.spawn(work).join().unwrap()
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Links `a` and `b` with a veth pair, each end up with its addresses (`10.0.0.2/24`,
/// `fd00::2/64`, …). `tag` (a few characters) keeps the interface names of tests running in
/// parallel apart; names have 15 bytes at most.
pub fn veth(a: &NetNs, b: &NetNs, tag: &str, a_addrs: &[&str], b_addrs: &[&str]) {
    let id = std::process::id() % 100_000;
    let (a_end, b_end) = (format!("{tag}a{id}"), format!("{tag}b{id}"));
    let run = |args: &[&str]| {
        let out = Command::new("ip").args(args).output().unwrap();
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "link", "add", &a_end, "type", "veth", "peer", "name", &b_end,
    ]);
    for (ns, end, addrs) in [(a, &a_end, a_addrs), (b, &b_end, b_addrs)] {
        run(&["link", "set", end, "netns", ns.name()]);
        for addr in addrs {
            let family = if addr.contains(':') { "-6" } else { "-4" };
            let mut args = vec!["-n", ns.name(), family, "addr", "add", addr, "dev", end];
            if family == "-6" {
                args.push("nodad");
            }
            run(&args);
        }
        run(&["-n", ns.name(), "link", "set", end, "up"]);
    }
}
